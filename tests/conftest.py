"""Shared fixtures: a tiny random-weight checkpoint and the media folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# PyAV before any test module imports decord: decord's own FFmpeg libraries, loaded first, leave PyAV unable to
# open some encoders (libvpx-vp9 fails with EINVAL), which the tests use to make their media.
import av  # noqa: F401  # isort: skip

# No GPU in the tests: Triton's kernels (the fused decode attention) run in its interpreter, on CPU tensors. Triton
# reads this when it is imported (the engine's imports bring it in), so before anything else.
os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest
import torch

from tarsier_batch.families.loading import load_caption_model
from tarsier_batch.families.tarsier.family import TarsierCaptionModel
from tarsier_batch.families.tiny import make_tiny_model

# Real stores on loopback: `s3` (moto's S3 API), `gcs` (gcp-storage-emulator), `azure` (Azurite), `http_store`
# (a web server).
pytest_plugins = ["s3_server", "gcs_server", "azure_server", "http_server", "hf_server"]

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "sample_data"
SHARED_MEDIA = REPO.parent / "shared" / "media"


@pytest.fixture(scope="session")
def shared_media() -> Path:
    if not (SHARED_MEDIA / "demo_test.mp4").exists():
        pytest.fail(f"shared media not found at {SHARED_MEDIA}: the tests expect ../shared beside the clone")
    return SHARED_MEDIA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> TarsierCaptionModel:
    return load_caption_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def all_pages_free(engine) -> bool:
    """Every page of every KV cache of `engine` is free and held by no row: what finished rows leave behind."""
    return all(pool.free_slots == pool.capacity_tokens and not pool.pool.holders.any() for pool in engine.pools)


@pytest.fixture
def no_room_to_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are admitted with no slot to spare: every row that grows past its prompt's pages takes a page no
    row holds, or preempts another. Pages come from anywhere, so with the usual room left at admission a small
    cache rarely preempts; tests of preemption need it to, whatever the sizes of their rows."""
    from tarsier_batch.engine import kv_manager

    monkeypatch.setattr(kv_manager, "FIRST_DECODE_RESERVE", 0)
    monkeypatch.setattr(kv_manager, "ADMISSION_WATERMARK", 0)


# `tarsier caption` in a fresh interpreter of this checkout, telling after it exits whether torch or transformers were
# imported: usage errors must be answered before the heavy imports.
_HEAVY_IMPORTS_PROBE = ("import sys, runpy; sys.argv = ['tarsier'] + sys.argv[1:]\n"
                        "try:\n    runpy.run_module('tarsier_batch.cli', run_name='__main__')\n"
                        "except SystemExit as stop:\n"
                        "    heavy = 'torch' in sys.modules or 'transformers' in sys.modules\n"
                        "    print('HEAVY', heavy, 'CODE', stop.code)\n")


def caption_probe(folder: Path, *flags: str) -> subprocess.CompletedProcess:
    """`tarsier caption FOLDER -o FOLDER/r.parquet FLAGS` (FOLDER holding one empty JPEG); its stdout ends with
    "HEAVY <torch or transformers imported> CODE <exit code>"."""
    (folder / "a.jpg").touch()
    return subprocess.run([sys.executable, "-c", _HEAVY_IMPORTS_PROBE, "caption", str(folder), "-o",
                           str(folder / "r.parquet"), *flags], capture_output=True, text=True, timeout=60, cwd=folder,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
