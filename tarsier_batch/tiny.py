"""Deterministic random-weight Tarsier v1 checkpoints in the real on-disk format.

No model hub is needed: the tokenizer is trained here on a small built-in text, the weights are
drawn from a seeded generator, and the files are those of omni-research/Tarsier-7b (config.json,
safetensors with the official key names, tokenizer files, preprocessor_config.json). Captions
from such a model are noise; it exists so the whole pipeline can run and be tested offline.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import CLIPVisionConfig, LlamaConfig, LlamaTokenizer

from .families.tarsier import ARCHITECTURE, TarsierConfig, TarsierModel
from .families.tarsier.weights import save_model

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

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
}

_TRAINING_TEXT = """
A man wearing a dark beanie peeks out from behind a tree in a snowy forest.
The camera slowly pans to the right and shows another man walking between the trees.
He carries a bundle of branches on his back and looks over his shoulder.
A small animal with very large eyes sits on a branch at night and turns its head.
The video shows a person riding a bicycle along a wet street while cars pass by.
Two children play with a red ball in a park; a dog runs after them and barks.
The image shows a cartoon mascot above a word written in bold letters on a white background.
A woman pours coffee into a white cup, then lifts it and smiles at the camera.
Describe the video in detail. Describe the image in detail. What happens next?
The scene changes to a close-up of hands typing on a keyboard in a dim room.
Snow falls steadily; the wind moves the branches and the light fades toward evening.
In the final shot, the first man raises his arm and points toward the distance.
"""
# Weights are drawn wider than transformers' default (0.02) so that outputs depend strongly on
# the input: with the default, every input yields nearly the same tokens, which hides mix-ups.
_INIT_SCALE = 0.3
_VOCAB_SIZE = 700  # before the added tokens; the embedding table is then rounded up to 64


def make_tiny_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight Tarsier v1 checkpoint of the given size to `out_dir`; returns it."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    _write_merges_as_strings(out_dir / "tokenizer.json")
    base = len(tokenizer)  # <image> and <pad> are the last two tokenizer ids
    raw = _config_dict(SIZES[size], image_token=tokenizer.convert_tokens_to_ids("<image>"),
                       pad_token=tokenizer.pad_token_id, newline=base, frame_end=base + 1,
                       vocab=_round_up(base + 2, 64))
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(_preprocessor_dict(SIZES[size]["image_size"]), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
         "pad_token_id": tokenizer.pad_token_id}, indent=2) + "\n")
    torch.manual_seed(seed)
    model = TarsierModel(TarsierConfig.from_dict(raw)).float()
    # Llama zeroes the <pad> embedding row at initialisation. The official decoder takes a
    # cached key of exact zeros for padding, so a generated <pad> would shift its positions;
    # trained checkpoints have no such row, and neither should ours.
    with torch.no_grad():
        model.language_model.get_input_embeddings().weight[tokenizer.pad_token_id].normal_(0, _INIT_SCALE)
    save_model(model, out_dir)
    return out_dir


def ensure_tiny_model(cache_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """The cached tiny checkpoint, built once (into a temporary folder, then moved in place)."""
    target = cache_dir / f"tiny-random-{size}-seed{seed}"
    if (target / "model.safetensors").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        make_tiny_model(staging, size, seed)
        os.replace(staging, target)
    except OSError:
        if not (target / "model.safetensors").exists():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_tokenizer() -> LlamaTokenizer:
    """A Llama-style tokenizer (BPE with byte fallback, metaspace) trained on the built-in text."""
    trainer_model = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Split at spaces while training so merges never span words, as in sentencepiece.
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    alphabet = [chr(code) for code in range(32, 127)]
    trainer = trainers.BpeTrainer(vocab_size=_VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    trainer_model.train_from_iterator(_TRAINING_TEXT.strip().splitlines(), trainer)
    model = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    tokenizer = LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True, add_eos_token=False)
    # Same order as the real checkpoints: <image> right after the base vocabulary, then <pad>.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def _write_merges_as_strings(tokenizer_json: Path) -> None:
    """Store BPE merges as "a b" strings, the form every tokenizers release reads (0.20+ writes pairs).

    Keeps the checkpoint loadable by the transformers 4.4x that the official code pins.
    """
    data = json.loads(tokenizer_json.read_text())
    data["model"]["merges"] = [" ".join(merge) if isinstance(merge, list) else merge
                               for merge in data["model"]["merges"]]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def _config_dict(size: dict[str, int], image_token: int, pad_token: int, newline: int,
                 frame_end: int, vocab: int) -> dict[str, Any]:
    vision = CLIPVisionConfig(
        image_size=size["image_size"], patch_size=size["patch_size"], hidden_size=size["vision_hidden"],
        intermediate_size=4 * size["vision_hidden"], num_hidden_layers=size["vision_layers"],
        num_attention_heads=size["vision_heads"], projection_dim=size["vision_hidden"],
        hidden_act="quick_gelu", layer_norm_eps=1e-5, initializer_factor=_INIT_SCALE / 0.02)
    text = LlamaConfig(
        vocab_size=vocab, hidden_size=size["text_hidden"], intermediate_size=size["text_intermediate"],
        num_hidden_layers=size["text_layers"], num_attention_heads=size["text_heads"],
        num_key_value_heads=size["text_kv_heads"], max_position_embeddings=8192, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=pad_token, tie_word_embeddings=False,
        initializer_range=_INIT_SCALE)
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
        "vision_config": _plain_config(vision),
        "text_config": _plain_config(text),
    }


def _plain_config(config: CLIPVisionConfig | LlamaConfig) -> dict[str, Any]:
    """A sub-config as the real checkpoints store it: the non-default fields and the model type.

    `rope_theta` is spelled out as well, for transformers 4.x, which does not read `rope_parameters`.
    """
    fields = config.to_diff_dict()
    fields.pop("transformers_version", None)
    rope = fields.get("rope_parameters") or {}
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    return {"model_type": config.model_type, **fields}


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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
