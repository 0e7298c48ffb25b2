"""Per-frame decoding and preprocessing give exactly the pixels of the whole-batch path.

`load_media(..., frame_transform=processor.frame_pixels)` decodes one frame at a time and keeps
only its pixel tensor. The reference below is the previous code path, kept here as the
specification: decord `get_batch` on all sampled indices at once, PIL frames, stretch to a
square, then the checkpoint's CLIP processor (transformers' class, PIL backend) on the whole list.
"""

from __future__ import annotations

import pickle
import time
import weakref
from pathlib import Path
from typing import Any

import decord
import pytest
import torch
from PIL import Image, ImageSequence
from transformers import AutoImageProcessor

from tarsier_batch.families.tarsier.processing import TarsierProcessor
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.media import MediaType, frame_indices, load_media
from tarsier_batch.media.decord_video import _decoder_runs

Facts = tuple[list[int], int, int, float | None]  # frame indices, width, height, duration


@pytest.fixture(scope="module")
def processors(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TarsierProcessor,
                                                                                                   Any]]:
    """56 px (the unit-test checkpoint) and 336 px (the real models' processor settings): each with transformers'
    own image processor for its checkpoint."""
    small_dir = make_tiny_model(tmp_path_factory.mktemp("small-model"), "small", seed=0)
    return {name: (TarsierProcessor(folder), AutoImageProcessor.from_pretrained(str(folder), backend="pil"))
            for name, folder in (("tiny", tiny_model_dir), ("small", small_dir))}


def whole_batch_frames(path: Path, media_type: MediaType, num_frames: int) -> tuple[list[Image.Image], Facts]:
    """The previous decoding: every sampled frame at once, then the facts from that batch."""
    if media_type is MediaType.VIDEO:
        reader = decord.VideoReader(str(path), num_threads=1, ctx=decord.cpu(0))
        indices = frame_indices(len(reader), num_frames)
        batch = reader.get_batch(indices).asnumpy()
        fps = reader.get_avg_fps()
        frames = [Image.fromarray(array).convert("RGB") for array in batch]
        return frames, (indices, int(batch.shape[2]), int(batch.shape[1]), len(reader) / fps)
    if media_type is MediaType.GIF:
        with Image.open(path) as gif:
            wanted = set(frame_indices(gif.n_frames, num_frames))
            frames, kept, duration_ms = [], [], 0
            for index, frame in enumerate(ImageSequence.Iterator(gif)):
                duration_ms += frame.info.get("duration", 0) or 0
                if index in wanted:
                    frames.append(frame.convert("RGB"))
                    kept.append(index)
            width, height = gif.size
        return frames, (kept, width, height, duration_ms / 1000 if duration_ms else None)
    with Image.open(path) as image:
        frame = image.convert("RGB")
    return [frame], ([0], frame.width, frame.height, None)


def whole_batch_pixels(image_processor: Any, frames: list[Image.Image]) -> torch.Tensor:
    """The previous preprocessing: stretch each frame to a square, one processor call on the list."""
    squares = [frame.resize((max(frame.size),) * 2, resample=Image.Resampling.BICUBIC) for frame in frames]
    return image_processor(images=squares, return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize(("name", "media_type", "num_frames"), [
    ("demo_test.mp4", MediaType.VIDEO, 8),
    ("demo_test.mp4", MediaType.VIDEO, 16),
    ("short_5f.mp4", MediaType.VIDEO, 8),         # 5 frames: indices repeat
    ("portrait_25fps.mp4", MediaType.VIDEO, 8),   # taller than wide
    ("clip_5f.gif", MediaType.GIF, 8),            # repeats collapse: 5 frames
    ("clip_12f.gif", MediaType.GIF, 8),
    ("demo_test_f40.jpg", MediaType.IMAGE, 8),
    ("tarsier_logo.jpg", MediaType.IMAGE, 8),     # ICC profile, nearly square
    ("portrait_200x333.png", MediaType.IMAGE, 8),
])
@pytest.mark.long
def test_per_frame_pixels_are_bit_identical_to_the_whole_batch(
        shared_media: Path, processors: dict[str, tuple[TarsierProcessor, Any]],
        name: str, media_type: MediaType, num_frames: int) -> None:
    path = shared_media / name
    reference_frames, reference_facts = whole_batch_frames(path, media_type, num_frames)

    # Without a transform, the frames and facts are what they were.
    plain = load_media(str(path), media_type, num_frames)
    assert (plain.frame_indices, plain.width, plain.height, plain.duration_s) == reference_facts
    assert len(plain.frames) == len(reference_frames)
    for frame, expected in zip(plain.frames, reference_frames):
        assert (frame.mode, frame.size) == (expected.mode, expected.size)
        assert frame.tobytes() == expected.tobytes()

    for size, (processor, image_processor) in processors.items():
        expected = whole_batch_pixels(image_processor, reference_frames)
        media = load_media(str(path), media_type, num_frames, frame_transform=processor.frame_pixels)
        assert (media.frame_indices, media.width, media.height, media.duration_s) == reference_facts
        assert len(media.frames) == expected.shape[0]
        side = image_processor.crop_size["height"]
        for index, pixels in enumerate(media.frames):
            assert pixels.shape == (3, side, side) and pixels.dtype == torch.float32
            assert torch.equal(pixels, expected[index]), f"{size}: frame {index} differs"
        assert torch.equal(torch.stack(media.frames), expected)
        assert torch.equal(processor.pixel_values(reference_frames), expected)


@pytest.mark.parametrize(("name", "num_frames"), [
    ("demo_test.mp4", 4), ("demo_test.mp4", 32), ("demo_test.mp4", 64),
    ("portrait_25fps.mp4", 32), ("short_5f.mp4", 16),
])
def test_video_frames_equal_one_get_batch_call_at_any_density(shared_media: Path, name: str, num_frames: int) -> None:
    """Decoding in runs (one pass per keyframe interval, a seek between) gives get_batch's pixels."""
    path = shared_media / name
    reference_frames, reference_facts = whole_batch_frames(path, MediaType.VIDEO, num_frames)
    media = load_media(str(path), MediaType.VIDEO, num_frames)
    assert (media.frame_indices, media.width, media.height, media.duration_s) == reference_facts
    assert [frame.tobytes() for frame in media.frames] == [frame.tobytes() for frame in reference_frames]


def test_video_repeats_are_decoded_and_transformed_once(shared_media: Path) -> None:
    seen: list[tuple[int, int]] = []

    def transform(frame: Image.Image, frame_count: int) -> object:
        seen.append(frame.size)
        return object()

    media = load_media(str(shared_media / "short_5f.mp4"), MediaType.VIDEO, 8, frame_transform=transform)
    assert media.frame_indices == [0, 1, 1, 2, 2, 3, 3, 4]
    assert len(seen) == 5 and len(media.frames) == 8
    assert [id(frame) for frame in media.frames[1:7:2]] == [id(frame) for frame in media.frames[2:8:2]]
    assert len({id(frame) for frame in media.frames}) == 5


@pytest.mark.parametrize(("name", "media_type", "calls"), [
    ("demo_test.mp4", MediaType.VIDEO, 8),
    ("clip_12f.gif", MediaType.GIF, 8),
    ("demo_test_f40.jpg", MediaType.IMAGE, 1),
])
def test_each_full_frame_is_released_before_the_next_is_decoded(
        shared_media: Path, monkeypatch: pytest.MonkeyPatch, name: str, media_type: MediaType, calls: int) -> None:
    """Neither the transform nor the decoder runs while an earlier frame given to the transform is alive."""
    earlier: list[weakref.ref[Image.Image]] = []

    def check_released(where: str) -> None:
        alive = [ref for ref in earlier if ref() is not None]
        assert not alive, f"{len(alive)} earlier frame(s) still alive {where} frame {len(earlier)}"

    real_get_batch = decord.VideoReader.get_batch

    def get_batch(reader: decord.VideoReader, indices: Any) -> Any:
        check_released("while decoding")
        return real_get_batch(reader, indices)

    monkeypatch.setattr(decord.VideoReader, "get_batch", get_batch)

    def transform(frame: Image.Image, frame_count: int) -> tuple[int, int]:
        check_released("while transforming")
        assert frame.mode == "RGB"
        earlier.append(weakref.ref(frame))
        return frame.size

    media = load_media(str(shared_media / name), media_type, 8, frame_transform=transform)
    assert len(earlier) == calls == len(media.frames)
    assert all(ref() is None for ref in earlier)  # only the transform's results are kept
    assert set(media.frames) == {(media.width, media.height)}


def test_decoder_runs_split_where_decord_seeks() -> None:
    # demo_test.mp4: 84 frames, keyframes at 0, 20, 31, 43 and 66. After frame i the reader
    # stands at i + 1 and decodes forward to j when both lie between the same two keyframes.
    keyframes = [0, 20, 31, 43, 66]
    assert _decoder_runs([0, 12, 24, 36, 47, 59, 71, 83], keyframes, 84) == [[0, 12], [24], [36], [47, 59], [71, 83]]
    assert _decoder_runs([18, 19, 20, 21, 30, 31], keyframes, 84) == [[18, 19, 20, 21, 30, 31]]  # i + 1 each time
    assert _decoder_runs([18, 25], keyframes, 84) == [[18], [25]]
    assert _decoder_runs([0, 1, 3], [], 5) == [[0, 1, 3]]  # no keyframe list: never seeks


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1000
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_decord_does_not_decode_ahead_while_frames_are_transformed(shared_media: Path) -> None:
    """decord's decoder thread keeps decoding queued packets into full-size frames in the
    background (~120 MB in 0.25 s on this clip); the loader stops it before transforming."""
    growth: list[float] = []

    def slow_transform(frame: Image.Image, frame_count: int) -> None:
        start = _rss_mb()
        time.sleep(0.25)  # as long as preprocessing a frame, or longer
        growth.append(_rss_mb() - start)

    load_media(str(shared_media / "demo_test.mp4"), MediaType.VIDEO, 4, frame_transform=slow_transform)
    assert len(growth) == 4
    assert max(growth) < 20, f"memory grew by {max(growth):.0f} MB while a frame was transformed"


def test_frame_pixels_survive_pickling(shared_media: Path, tiny_model_dir: Path) -> None:
    """A bound method of a plain object: it can be shipped to worker processes."""
    processor = TarsierProcessor(tiny_model_dir)
    shipped: Any = pickle.loads(pickle.dumps(processor.frame_pixels))
    with Image.open(shared_media / "demo_test_f40.jpg") as image:
        frame = image.convert("RGB")
    assert torch.equal(shipped(frame), processor.frame_pixels(frame))
