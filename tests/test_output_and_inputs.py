"""Input discovery, model resolution and OOM retries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tarsier_batch import Captioner, CaptionSettings, SamplingParams
from tarsier_batch.cli_options import in_flags
from tarsier_batch.inputs.sources import InputNotFoundError, discover
from tarsier_batch.model.checkpoints import ModelNotFoundError, resolve_model


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_discovery_order_recursion_skips_and_duplicates(tmp_path: Path) -> None:
    for name in ["b.mp4", "a.GIF", "sub/c.jpg", "sub/deeper/d.webm", "notes.txt", "data.json", ".hidden.mp4",
                 ".cache/e.mp4", "z.PNG"]:
        touch(tmp_path / name)
    found = discover([str(tmp_path), str(tmp_path / "b.mp4")])
    names = [os.path.relpath(item.path, tmp_path) for item in found.items]
    assert names == ["a.GIF", "b.mp4", "sub/c.jpg", "sub/deeper/d.webm", "z.PNG"]
    assert [item.media_type.value for item in found.items] == ["gif", "video", "image", "video", "image"]
    assert dict(found.skipped) == {".txt": 1, ".json": 1} and found.skipped_count == 2
    flat = discover([str(tmp_path)], recursive=False)
    assert [os.path.basename(item.path) for item in flat.items] == ["a.GIF", "b.mp4", "z.PNG"]


def test_globs_expand_sorted_and_must_match(tmp_path: Path) -> None:
    for name in ["x/2.mp4", "x/1.mp4", "x/y/3.mp4", "x/n.txt"]:
        touch(tmp_path / name)
    found = discover([str(tmp_path / "x" / "**" / "*.mp4")])
    assert [os.path.relpath(item.path, tmp_path) for item in found.items] == ["x/1.mp4", "x/2.mp4", "x/y/3.mp4"]
    with pytest.raises(InputNotFoundError, match="no file matches"):
        discover([str(tmp_path / "*.avi")])
    with pytest.raises(InputNotFoundError, match="input not found"):
        discover([str(tmp_path / "missing_folder")])


def test_vanished_media_paths_and_odd_entries_become_items(tmp_path: Path) -> None:
    """A piped path named like media that is gone is kept: its row will say why it failed (one typed is refused,
    test_a_typed_media_path_that_does_not_exist_is_refused)."""
    clip = touch(tmp_path / "in" / "clip.mp4")
    (tmp_path / "in" / "link1.mp4").symlink_to(clip)
    (tmp_path / "in" / "link2.mp4").symlink_to(clip)
    (tmp_path / "in" / "folder.mp4").mkdir()
    touch(tmp_path / "in" / "folder.mp4" / "inside.mp4")  # a folder named like media is an item, not walked
    (tmp_path / "in" / "loop.mp4").symlink_to(tmp_path / "in" / "loop.mp4")
    os.mkfifo(tmp_path / "in" / "pipe.mp4")
    found = discover([str(tmp_path / "in"), "-"], piped=[str(tmp_path / "gone.mp4"), str(tmp_path / "piped.gif")],
                     key_mode="path")
    names = [os.path.relpath(item.path, tmp_path) for item in found.items]
    assert names == ["in/clip.mp4", "in/folder.mp4", "in/link1.mp4", "in/link2.mp4", "in/loop.mp4", "in/pipe.mp4",
                     "gone.mp4", "piped.gif"]
    keys = {name: item.key for name, item in zip(names, found.items)}
    info = clip.stat()
    assert keys["in/clip.mp4"] == f"{clip}|{info.st_size}|{info.st_mtime_ns}"
    assert keys["in/link1.mp4"] == keys["in/link2.mp4"] == keys["in/clip.mp4"]  # one content, three rows
    assert keys["in/pipe.mp4"].endswith("|not-a-file") and keys["gone.mp4"].endswith("|unavailable")
    assert keys["in/folder.mp4"].endswith("|not-a-file") and keys["in/loop.mp4"].endswith("|unavailable")


def test_a_typed_media_path_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    """`tarsier caption nothere.mp4` loaded the model, then failed the row: "the file no longer exists"."""
    touch(tmp_path / "here.mp4")
    with pytest.raises(InputNotFoundError, match="input not found: .*nothere.mp4"):
        discover([str(tmp_path / "here.mp4"), str(tmp_path / "nothere.mp4")])


def test_sha256_keys_follow_content_not_names(tmp_path: Path) -> None:
    from tarsier_batch.inputs.sources import item_key

    a, b = touch(tmp_path / "a.mp4"), touch(tmp_path / "b.mp4")
    assert item_key(str(a), "sha256") == item_key(str(b), "sha256") != item_key(str(a), "path")
    before = item_key(str(a), "path")
    a.write_bytes(b"changed")
    assert item_key(str(a), "sha256") != item_key(str(b), "sha256") and item_key(str(a), "path") != before


def test_offline_hub_id_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    # huggingface_hub reads its environment at import time, so switch the constants themselves:
    # no traffic leaves this test, and no real cache is consulted.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="pass model DIR$") as offline:   # the library names the field
        resolve_model("omni-research/Tarsier-7b")
    assert in_flags(offline.value).endswith("pass --model DIR")                   # the command line, its flag
    with pytest.raises(ModelNotFoundError, match="not a checkpoint directory"):
        resolve_model("./no/such/dir")


@pytest.mark.parametrize(("alias", "text_model_type"), [("tiny-random", "llama"), ("tiny-random-tarsier2", "qwen2_vl")])
def test_tiny_random_alias_builds_once_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      alias: str, text_model_type: str) -> None:
    import json

    monkeypatch.setenv("TARSIER_BATCH_CACHE", str(tmp_path / "cache"))
    first = resolve_model(alias)
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    second = resolve_model(alias)
    assert first.path == second.path and first.path.parent == tmp_path / "cache"
    assert (second.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first.path / "config.json").read_text())["text_config"]["model_type"] == text_model_type


def test_out_of_memory_lowers_the_step_budget_and_the_run_completes(tiny_model_dir: Path, shared_media: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tarsier_batch.inputs.sources import MediaItem
    from tarsier_batch.media import MediaType

    settings = CaptionSettings(model=str(tiny_model_dir), batch_size=4, sampling=SamplingParams(max_new_tokens=5),
                               dtype="float32", device="cpu")
    items = [MediaItem(str(shared_media / name), MediaType.IMAGE)
             for name in ["tarsier_logo.jpg", "demo_test_f40.jpg", "portrait_200x333.png"]]
    expected = [r.generated_ids for r in Captioner(settings).caption(items)]
    captioner = Captioner(settings)
    real_encode = captioner.model.encode_vision
    calls: list[int] = []

    def encode_with_tight_memory(pixels, blocks):  # the first two attempts run out of memory
        calls.append(len(blocks))
        if len(calls) <= 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_encode(pixels, blocks)

    monkeypatch.setattr(captioner.model, "encode_vision", encode_with_tight_memory)
    results = list(captioner.caption(items))
    assert [r.generated_ids for r in results] == expected
    assert captioner.engine.scheduler.max_batch_tokens == captioner.engine.config.max_batch_tokens // 4
    assert sum(calls[2:]) == len(items), "each frame is encoded once the step fits"


def test_unreadable_folders_are_reported_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    touch(tmp_path / "ok" / "a.mp4")
    locked = tmp_path / "locked"
    touch(locked / "b.mp4")
    real_scandir = os.scandir

    def scandir_refusing_locked(path="."):  # as for a folder without read permission (tests run as root)
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(locked))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir_refusing_locked)
    found = discover([str(tmp_path)])
    flat = discover([str(locked)], recursive=False)
    assert [Path(item.path).name for item in found.items] == ["a.mp4"]
    assert found.unreadable == [f"{locked}: Permission denied"]
    assert flat.items == [] and flat.unreadable == [f"{locked}: Permission denied"]


def test_stopping_early_cancels_queued_decodes(tiny_model_dir: Path, shared_media: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Synchronised by events only: no step of the model or the decoders is timed."""
    import threading

    from tarsier_batch.inputs.sources import MediaItem
    from tarsier_batch.media import MediaType
    from tarsier_batch.workers import pool as workers

    settings = CaptionSettings(model=str(tiny_model_dir), batch_size=1, workers=1, isolate_decoding=False,
                               sampling=SamplingParams(max_new_tokens=1), dtype="float32", device="cpu")
    captioner = Captioner(settings)
    started: list[int] = []
    second_started, second_may_finish = threading.Event(), threading.Event()
    real_decode, real_shutdown = workers.decode_item, workers.DecodePool.shutdown

    def gated_decode(job, index, item):  # the second decode holds the only worker until the stop
        started.append(index)
        if index == 1:
            second_started.set()
            second_may_finish.wait()
        return real_decode(job, index, item)

    def shutdown_releasing_the_second(pool) -> None:
        assert pool._threads is not None
        pool._threads.shutdown(wait=False, cancel_futures=True)  # the queued decodes are dropped first...
        second_may_finish.set()                                  # ...then the running one may end
        real_shutdown(pool)

    monkeypatch.setattr(workers, "decode_item", gated_decode)
    monkeypatch.setattr(workers.DecodePool, "shutdown", shutdown_releasing_the_second)
    items = [MediaItem(str(shared_media / "clip_5f.gif"), MediaType.GIF)] * 10
    results = captioner.caption(items)
    first = next(results)
    assert first.ok
    assert second_started.wait(timeout=60)
    results.close()  # what Ctrl-C or an abandoned iterator does
    # Item 1 was being decoded when we stopped; the queued item 2 never starts.
    assert started == [0, 1]
    assert not captioner.engine.has_work


def test_kv_cache_takes_what_the_accelerator_can_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    from tarsier_batch.model.devices import (
        CPU_KV_CACHE_BYTES,
        CUDA_ACTIVATION_BYTES_PER_BATCH_TOKEN,
        CUDA_KV_SHARE,
        CUDA_RESERVED_BYTES,
        kv_cache_bytes,
    )

    free = 40 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    spare = free - CUDA_RESERVED_BYTES - 4096 * CUDA_ACTIVATION_BYTES_PER_BATCH_TOKEN
    assert kv_cache_bytes(torch.device("cuda"), None, 4096) == int(spare * CUDA_KV_SHARE)
    assert kv_cache_bytes(torch.device("cuda"), 2.5, 4096) == int(2.5 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    assert kv_cache_bytes(torch.device("cuda"), None, 4096) == 0
    assert 0 < kv_cache_bytes(torch.device("cpu"), None, 4096) <= CPU_KV_CACHE_BYTES
