"""A random-weight Tarsier2 checkpoint at the real Tarsier2-7B size, written one tensor at a time.

    python bench/make_real_size_checkpoint.py OUT_DIR [--dtype bfloat16] [--shard-gb 4] [--device cuda]

The memory preflight's estimate has to hold for the model users run, which cannot be downloaded
here. This writes one with the same geometry (8.29 B parameters: a 32-block 1280-wide vision
tower, a 28-layer 3584-wide language model with 4 KV heads and a 152,064-token vocabulary), in
the official layout (config.json, sharded safetensors with an index, the tiny checkpoint's
tokenizer and processor files). The model is built on the meta device to learn its tensors' names
and shapes, and each tensor is drawn and written straight to its shard: the builder itself holds
one tensor at a time (the largest is the 1.1 GB embedding), never the model. `--device cuda`
draws each tensor on the GPU (seconds instead of minutes for 8.3 B normal draws); the values then
differ from the CPU's, the geometry and the layout do not.

`--family qwen2_5_vl` writes Qwen2.5-VL-7B-Instruct's instead (8.29 B parameters: a 32-block 1280-wide vision
tower with window attention, the same language model), in its own layout (a flat config.json, weights under
`visual.`, `model.` and `lm_head.`).

Prints one JSON object: parameters, bytes written, seconds.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tarsier_batch.families.qwen2_vl import QWEN2_5_VL_VARIANT, QwenVLConfig, QwenVLModel  # noqa: E402
from tarsier_batch.families.tarsier2 import Tarsier2Config, Tarsier2Model  # noqa: E402
from tarsier_batch.families.tiny import qwen2_vl as tiny_qwen  # noqa: E402
from tarsier_batch.families.tiny import tarsier2 as tiny  # noqa: E402

# Tarsier2-Recap-7b's geometry (its config.json), in the tiny builder's terms.
REAL = dict(embed_dim=1280, depth=32, vision_heads=16, text_hidden=3584, text_intermediate=18944, text_layers=28,
            text_heads=28, text_kv_heads=4, mrope_section=[16, 24, 24], max_pixels=tiny.QWEN2_VL_MAX_PIXELS)
REAL_VOCAB = 152_064
# Qwen2.5-VL-7B-Instruct's (its config.json), in the tiny Qwen builder's terms; then the vision settings that builder
# sets for small towers, at the 7B's values.
REAL_QWEN2_5_VL = dict(embed_dim=1280, depth=32, vision_heads=16, text_hidden=3584, text_intermediate=18944,
                       text_layers=28, text_heads=28, text_kv_heads=4, mrope_section=[16, 24, 24],
                       max_pixels=12_845_056)
REAL_QWEN2_5_VL_VISION = {"intermediate_size": 3420, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--shard-gb", type=float, default=4.0)
    parser.add_argument("--device", default="cpu", help="where each tensor is drawn (cpu, cuda)")
    parser.add_argument("--family", choices=["tarsier2", "qwen2_5_vl"], default="tarsier2")
    args = parser.parse_args()
    writer = write_qwen2_5_vl_checkpoint if args.family == "qwen2_5_vl" else write_checkpoint
    print(json.dumps(writer(args.out_dir, getattr(torch, args.dtype), torch.device(args.device),
                            shard_gb=args.shard_gb)))


def write_checkpoint(out_dir: Path, dtype: torch.dtype, device: torch.device, geometry: dict | None = None,
                     vocab: int = REAL_VOCAB, shard_gb: float = 4.0) -> dict:
    """Write the checkpoint (`geometry` in the tiny builder's terms, the real one by default) into `out_dir`;
    returns its parameters, bytes, shards, dtype and seconds."""
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    geometry = geometry or REAL
    tiny.build(out_dir, "tiny", seed=0)           # tokenizer, processor and generation files
    ids = json.loads((out_dir / "config.json").read_text())
    special = {token: ids["text_config"][key] for token, key in
               (("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id"),
                ("<|vision_start|>", "vision_start_token_id"), ("<|vision_end|>", "vision_end_token_id"))}
    special.update({"<|endoftext|>": ids["text_config"]["bos_token_id"],
                    "<|im_end|>": ids["text_config"]["eos_token_id"]})
    raw = tiny._config_dict(geometry, special, vocab=vocab)
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(tiny._preprocessor_dict(geometry["max_pixels"]),
                                                                 indent=2) + "\n")
    (out_dir / "model.safetensors").unlink()
    with torch.device("meta"):
        skeleton = Tarsier2Model(Tarsier2Config.from_dict(raw))
    shapes = [(name, tuple(parameter.shape)) for name, parameter in skeleton.named_parameters()]
    return _write_weights(out_dir, shapes, dtype, device, shard_gb, start)


def write_qwen2_5_vl_checkpoint(out_dir: Path, dtype: torch.dtype, device: torch.device, geometry: dict | None = None,
                                vocab: int = REAL_VOCAB, shard_gb: float = 4.0) -> dict:
    """Write a Qwen2.5-VL checkpoint (`geometry` in the tiny Qwen builder's terms, Qwen2.5-VL-7B's by default) into
    `out_dir`; returns what `write_checkpoint` does. Untied output head, as the 7B's."""
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tiny_qwen.build(out_dir, "tiny", seed=0, variant=QWEN2_5_VL_VARIANT)   # tokenizer, processor, generation files
    tiny_raw = json.loads((out_dir / "config.json").read_text())
    special = {token: tiny_raw[key] for token, key in
               (("<|endoftext|>", "bos_token_id"), ("<|im_end|>", "eos_token_id"),
                ("<|vision_start|>", "vision_start_token_id"), ("<|vision_end|>", "vision_end_token_id"),
                ("<|vision_pad|>", "vision_token_id"), ("<|image_pad|>", "image_token_id"),
                ("<|video_pad|>", "video_token_id"))}
    raw = tiny_qwen.config_dict(QWEN2_5_VL_VARIANT, geometry or REAL_QWEN2_5_VL, special, vocab)
    if geometry is None:
        raw["vision_config"].update(REAL_QWEN2_5_VL_VISION)
    raw.update(tie_word_embeddings=False, torch_dtype=str(dtype).removeprefix("torch."))
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    processor = json.loads((out_dir / "preprocessor_config.json").read_text())
    processor["max_pixels"] = (geometry or REAL_QWEN2_5_VL)["max_pixels"]
    (out_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (out_dir / "model.safetensors").unlink()
    with torch.device("meta"):
        skeleton = QwenVLModel(QwenVLConfig.from_dict(raw, QWEN2_5_VL_VARIANT))
    shapes = [(QWEN2_5_VL_VARIANT.checkpoint_key(name), tuple(parameter.shape))
              for name, parameter in skeleton.named_parameters()]
    return _write_weights(out_dir, shapes, dtype, device, shard_gb, start)


def _write_weights(out_dir: Path, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                   device: torch.device, shard_gb: float, start: float) -> dict:
    """Draw and write the named tensors in shards with their index; what the checkpoint holds and how long it took
    since `start`."""
    shards = _split(shapes, int(shard_gb * 1e9), dtype.itemsize)
    weight_map, written = {}, 0
    generator = torch.Generator(device).manual_seed(0)
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        written += _write_shard(out_dir / name, shard, dtype, generator)
        weight_map.update({tensor: name for tensor, _ in shard})
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map}, indent=2) + "\n")
    return {"parameters": sum(_count(shape) for _, shape in shapes), "bytes": written, "shards": len(shards),
            "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "seconds": round(time.perf_counter() - start, 1)}


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _split(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int, itemsize: int
           ) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        tensor_bytes = _count(shape) * itemsize
        if shards[-1] and size + tensor_bytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += tensor_bytes
    return shards


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 generator: torch.Generator) -> int:
    """The safetensors format by hand (8-byte header length, JSON header, data), so that tensors can be written as
    they are drawn (on the generator's device). Norm weights are ones, the rest small normal values, so that the
    model runs without overflow."""
    header, offset = {}, 0
    for name, shape in tensors:
        size = _count(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in tensors:
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                tensor = torch.ones(shape, dtype=dtype)
            else:
                tensor = torch.empty(shape, dtype=torch.float32, device=generator.device).normal_(
                    0, 0.02, generator=generator).to(dtype)
            out.write(tensor.reshape(-1).view(torch.uint8).cpu().numpy())
    return offset


if __name__ == "__main__":
    main()
