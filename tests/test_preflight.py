"""The memory preflight: a model that does not fit stops at once with the numbers and a fix, and the estimate is
close to the peak a real run reaches."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import SAMPLE_DATA
from tarsier_batch import CaptionSettings, Question, SamplingParams
from tarsier_batch.families.tiny import make_tiny_model
from tarsier_batch.model.preflight import available_bytes, estimate, weight_bytes


def test_weights_from_the_headers(tiny_model_dir: Path) -> None:
    """On the CPU, loaded in their stored dtype, tensors stay mapped from the file and the embedding is read a row per
    token; converted, every tensor is a copy and the file is mapped while it is read."""
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    assert {tensor.dtype for tensor in tensors.values()} == {torch.float32}
    stored = sum(tensor.numel() * 4 for tensor in tensors.values())
    embedding = next(tensor for key, tensor in tensors.items() if key.endswith("embed_tokens.weight"))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")   # the estimate for a device, not a device in use
    assert weight_bytes(tiny_model_dir, torch.float32, cpu) == stored - embedding.numel() * 4
    assert weight_bytes(tiny_model_dir, torch.bfloat16, cpu) == stored // 2 + stored
    # On a GPU every tensor is a device copy; a converted one arrives as stored first.
    largest = max(tensor.numel() * 4 for tensor in tensors.values())
    assert weight_bytes(tiny_model_dir, torch.float32, cuda) == stored
    assert weight_bytes(tiny_model_dir, torch.bfloat16, cuda) == stored // 2 + largest


def test_the_kv_estimate_counts_the_longest_answer_a_prompt_set_allows(tiny_model_dir: Path) -> None:
    """A question of a prompt set may allow more tokens than the run's --max-new-tokens: each row's KV counts them."""
    cpu, sampling = torch.device("cpu"), SamplingParams(max_new_tokens=64)
    plain = CaptionSettings(sampling=sampling, kv_cache_gb=64)
    asking = replace(plain, prompt_set=(Question("caption", "Describe."), Question("long", "Tell all.", 1024)))
    kv = [estimate(tiny_model_dir, settings, torch.float32, cpu, rows=2, prompt_positions=100, pixel_bytes=0).kv_cache
          for settings in (plain, asking)]
    assert kv[1] / kv[0] == pytest.approx((100 + 1024) / (100 + 64))


def test_deepstack_features_count_where_the_family_declares_them(tmp_path: Path) -> None:
    """Qwen3-VL's vision vectors carry a hidden-size DeepStack feature per layer that takes them: the estimate for
    its checkpoint exceeds that of the same files and geometry read as a Qwen2-VL checkpoint by those features,
    held for the vectors the step's blocks encode and twice for the step's inputs (gathered, then widened)."""
    qwen3 = make_tiny_model(tmp_path / "qwen3_vl", "tiny", seed=0, family="qwen3_vl")
    as_qwen2 = Path(shutil.copytree(qwen3, tmp_path / "as-qwen2-vl"))
    config = json.loads((qwen3 / "config.json").read_text())
    (as_qwen2 / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_vl"}))
    cpu, settings, prompt_positions = torch.device("cpu"), CaptionSettings(kv_cache_gb=64, max_batch_tokens=96), 500
    with_features, without = (estimate(folder, settings, torch.bfloat16, cpu, rows=2, prompt_positions=prompt_positions,
                                       pixel_bytes=0) for folder in (qwen3, as_qwen2))
    features = len(config["vision_config"]["deepstack_visual_indexes"]) * config["text_config"]["hidden_size"] * 2
    held = min(prompt_positions, 4 * 96) + 2 * 96
    assert features > 0 and with_features.activations - without.activations == held * features
    assert (with_features.weights, with_features.kv_cache, with_features.pixels) == \
        (without.weights, without.kv_cache, without.pixels)


def _too_big_checkpoint(tiny_model_dir: Path, folder: Path) -> Path:
    """The tiny checkpoint with one more float32 tensor of 1.5x this machine's available memory, in a sparse file
    (the preflight reads headers only; nothing reads the tensor's data)."""
    shutil.copytree(tiny_model_dir, folder)
    path = folder / "model.safetensors"
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        data = handle.read()
    extra = int(1.5 * available_bytes(torch.device("cpu"))) // 4
    header["zz_padding.weight"] = {"dtype": "F32", "shape": [extra], "data_offsets": [len(data), len(data) + extra * 4]}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded + data)
        handle.truncate(8 + len(encoded) + len(data) + extra * 4)
    return folder


def _caption(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tarsier_batch.cli", "caption", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.long
def test_a_model_that_does_not_fit_stops_before_loading_with_the_numbers_and_a_fix(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    checkpoint = _too_big_checkpoint(tiny_model_dir, tmp_path / "big")
    started = time.perf_counter()
    done = _caption(str(SAMPLE_DATA), "--model", str(checkpoint), "-o", "r.parquet", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert time.perf_counter() - started < 60
    message = done.stderr.strip().splitlines()[-1]
    needed, available = (float(value) for value in re.search(r"need ~([\d.]+) GB in float32 .* ([\d.]+) GB available",
                                                             message).groups())
    assert needed > available
    assert "--dtype bfloat16" in message and "--no-preflight" in message
    assert not (tmp_path / "r.parquet").exists() and not list(tmp_path.glob(".r.parquet*"))
    # Skipped, the run goes on to load the checkpoint: its file cannot be mapped, or its loader finds the tensor the
    # model lacks (whichever comes first on this machine).
    skipped = _caption(str(SAMPLE_DATA), "--model", str(checkpoint), "-o", "r.parquet", "--no-preflight", cwd=tmp_path)
    assert skipped.returncode == 2 and "model.safetensors" in skipped.stderr, skipped.stderr
    assert "GB available" not in skipped.stderr


PEAK_PROBE = """
import sys
from tarsier_batch.cli import app

if __name__ == "__main__":
    try:
        app(sys.argv[1:])
    finally:   # VmHWM: this process's own peak (ru_maxrss would keep the parent's from before exec)
        print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")), file=sys.stderr)
"""


@pytest.mark.long
@pytest.mark.parametrize("model", ["tiny", "tiny-tarsier2", "tiny-qwen2_5_vl", "tiny-qwen3_vl", "demo"])
def test_the_estimate_is_within_15_percent_of_the_measured_peak(model: str, tmp_path: Path, shared_media: Path
                                                                ) -> None:
    checkpoint = "demo" if model == "demo" else str(make_tiny_model(
        tmp_path / model, "tiny", seed=0, family=model.removeprefix("tiny-") if "-" in model else "tarsier"))
    probe = tmp_path / "probe.py"
    probe.write_text(PEAK_PROBE)
    inputs = [str(SAMPLE_DATA), str(shared_media / "demo_test.mp4")]
    done = subprocess.run([sys.executable, str(probe), "caption", *inputs, "--model", checkpoint, "-o", "r.parquet",
                           "--max-new-tokens", "16"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    estimated = float(re.search(r"~([\d.]+) GB at the peak \(estimated\)", done.stderr).group(1)) * 1e9
    measured = int(re.search(r"VmHWM:\s+(\d+) kB", done.stderr).group(1)) * 1024
    print(f"{model}: estimated {estimated / 1e6:.0f} MB, measured {measured / 1e6:.0f} MB")
    assert abs(estimated - measured) <= 0.15 * measured, (estimated / 1e6, measured / 1e6)
    # The KV cache's reservation, far above the peak on the CPU, is said to be only reserved.
    reserved = float(re.search(r"KV cache [\d,]+ tokens \(([\d.]+) GiB reserved, used as rows fill it\)",
                               done.stderr).group(1)) * 2**30
    assert reserved > measured
