"""Deterministic random-weight Tarsier v1 checkpoints in the real on-disk format.

No model hub is needed: the tokenizer is trained here on a small built-in text, the weights are
drawn from a seeded generator, and the files are those of omni-research/Tarsier-7b (config.json,
safetensors with the official key names, tokenizer files, preprocessor_config.json). Captions
from such a model are noise; it exists so the whole pipeline can run and be tested offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import CLIPVisionConfig, LlamaConfig, LlamaTokenizer

from ..tarsier.config import ARCHITECTURE, TarsierConfig
from ..tarsier.modeling import TarsierModel
from ..tarsier.weights import save_model
from .common import (
    BASE_VOCAB_SIZE,
    CLIP_MEAN,
    CLIP_STD,
    INIT_SCALE,
    TRAINING_TEXT,
    plain_config,
    round_up,
    write_merges_as_strings,
)

# (vision: image size, patch, hidden, layers, heads) and
# (text: hidden, MLP intermediate, layers, heads, kv heads); the vision MLP is 4 x its hidden.
SIZES: dict[str, dict[str, int]] = {
    # 56 px / patch 14: a 4 x 4 grid, 4 * 5 + 1 = 21 vectors per frame; fast enough for unit tests.
    "tiny": dict(image_size=56, patch_size=14, vision_hidden=32, vision_layers=3, vision_heads=2,
                 text_hidden=64, text_intermediate=192, text_layers=2, text_heads=4, text_kv_heads=2),
    # The real geometry: 336 px / patch 14, 24 x 24 patches, 601 vectors per frame.
    "small": dict(image_size=336, patch_size=14, vision_hidden=64, vision_layers=3, vision_heads=4,
                  text_hidden=128, text_intermediate=384, text_layers=2, text_heads=4, text_kv_heads=2),
    # Decode-bound benchmarks: a ~104M-parameter LM (Llama, multi-head like Tarsier-7b, MLP 2.75 x
    # hidden) behind short prompts: 112 px / patch 14, 8 x 8 patches, 8 * 9 + 1 = 73 vectors per frame.
    "bench": dict(image_size=112, patch_size=14, vision_hidden=64, vision_layers=3, vision_heads=4,
                  text_hidden=1024, text_intermediate=2816, text_layers=8, text_heads=16, text_kv_heads=16),
    # Long-video memory benchmarks: the same LM with the real 601 vectors per frame.
    "wide": dict(image_size=336, patch_size=14, vision_hidden=64, vision_layers=3, vision_heads=4,
                 text_hidden=1024, text_intermediate=2816, text_layers=8, text_heads=16, text_kv_heads=16),
    # Pruning benchmarks: a ~103M-parameter LM at Tarsier-7b's depth (32 layers, head dim 128) with the
    # real 601 vectors per frame, so that "after layer K" leaves the real share of layers.
    "deep": dict(image_size=336, patch_size=14, vision_hidden=64, vision_layers=3, vision_heads=4,
                 text_hidden=512, text_intermediate=1408, text_layers=32, text_heads=4, text_kv_heads=4),
}


def build(out_dir: Path, size: str, seed: int, geometry: dict[str, int] | None = None,
          extra_text: str = "", init_scale: float = INIT_SCALE) -> TarsierModel:
    """Write a random-weight Tarsier v1 checkpoint of `size` (a key of SIZES) into `out_dir`; returns it.

    `geometry` replaces SIZES[size]; `extra_text` is added to the tokenizer's training text (the
    demo model's captions become whole tokens). `init_scale` is the weights' standard deviation:
    a model to be trained wants transformers' 0.02, not the test models' wide draw.
    """
    tokenizer = _build_tokenizer(extra_text)
    tokenizer.save_pretrained(str(out_dir))
    write_merges_as_strings(out_dir / "tokenizer.json")
    base = len(tokenizer)  # <image> and <pad> are the last two tokenizer ids
    shape = geometry or SIZES[size]
    raw = _config_dict(shape, image_token=tokenizer.convert_tokens_to_ids("<image>"),
                       pad_token=tokenizer.pad_token_id, newline=base, frame_end=base + 1,
                       vocab=round_up(base + 2, 64), init_scale=init_scale)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(_preprocessor_dict(shape["image_size"]), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
         "pad_token_id": tokenizer.pad_token_id}, indent=2) + "\n")
    torch.manual_seed(seed)
    model = TarsierModel(TarsierConfig.from_dict(raw)).float()
    # Llama zeroes the <pad> embedding row at initialisation. The official decoder takes a
    # cached key of exact zeros for padding, so a generated <pad> would shift its positions;
    # trained checkpoints have no such row, and neither should ours.
    with torch.no_grad():
        model.language_model.get_input_embeddings().weight[tokenizer.pad_token_id].normal_(0, init_scale)
    save_model(model, out_dir)
    return model


def _build_tokenizer(extra_text: str = "") -> LlamaTokenizer:
    """A Llama-style tokenizer (BPE with byte fallback, metaspace) trained on the built-in text."""
    trainer_model = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Split at spaces while training so merges never span words, as in sentencepiece.
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    alphabet = [chr(code) for code in range(32, 127)]
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    trainer_model.train_from_iterator((TRAINING_TEXT + extra_text).strip().splitlines(), trainer)
    model = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    tokenizer = LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True, add_eos_token=False)
    # Same order as the real checkpoints: <image> right after the base vocabulary, then <pad>.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def _config_dict(size: dict[str, int], image_token: int, pad_token: int, newline: int,
                 frame_end: int, vocab: int, init_scale: float) -> dict[str, Any]:
    vision = CLIPVisionConfig(
        image_size=size["image_size"], patch_size=size["patch_size"], hidden_size=size["vision_hidden"],
        intermediate_size=4 * size["vision_hidden"], num_hidden_layers=size["vision_layers"],
        num_attention_heads=size["vision_heads"], projection_dim=size["vision_hidden"],
        hidden_act="quick_gelu", layer_norm_eps=1e-5, initializer_factor=init_scale / 0.02)
    text = LlamaConfig(
        vocab_size=vocab, hidden_size=size["text_hidden"], intermediate_size=size["text_intermediate"],
        num_hidden_layers=size["text_layers"], num_attention_heads=size["text_heads"],
        num_key_value_heads=size["text_kv_heads"], max_position_embeddings=8192, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=pad_token, tie_word_embeddings=False,
        initializer_range=init_scale)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": image_token,
        "image_newline_idx": newline,
        "image_new_idx": frame_end,
        "pad_token_id": pad_token,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": vocab,
        "torch_dtype": "float32",
        "vision_config": plain_config(vision),
        "text_config": plain_config(text),
    }


def _preprocessor_dict(image_size: int) -> dict[str, Any]:
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "do_convert_rgb": True,
    }
