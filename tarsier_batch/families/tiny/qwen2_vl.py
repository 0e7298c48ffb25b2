"""Deterministic random-weight Qwen2-VL and Qwen2.5-VL checkpoints in the published on-disk layout.

The files of Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct: a flat config.json (`model_type
"qwen2_vl"` / `"qwen2_5_vl"`, text settings at the top level, `rope_scaling {"type": "mrope"}`, a nested
`vision_config`), model.safetensors under `visual.`, `model.` and `lm_head.` (none in a tied checkpoint, as
Qwen2.5-VL-3B), the Qwen2 byte-level BPE tokenizer with the Qwen2-VL special tokens, preprocessor_config.json
(a Qwen2VLImageProcessor), chat_template.json (the system turn, one pad token per image or video) and
generation_config.json with the published repetition penalty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..qwen2_vl import QWEN2_VL_VARIANT, QwenVLConfig, QwenVLModel, Variant
from ..weights import save_weights
from .common import CLIP_MEAN, CLIP_STD, INIT_SCALE, round_up
from .tarsier2 import (
    MIN_PIXELS,
    REPETITION_PENALTY,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_json,
    write_tokenizer_config_for_older_readers,
)
from .tarsier2 import SIZES as TARSIER2_SIZES

_DEFAULT_SYSTEM_TURN = (
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}")
_TURN = (
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}")


def chat_template(default_system_turn: bool) -> str:
    """The published templates' rendering: a default system turn unless the conversation opens with one (Qwen2-VL,
    Qwen2.5-VL; not Qwen3-VL), each image or video as <|vision_start|> + one pad token + <|vision_end|> (the
    processor expands the pad), then the text."""
    return ("{%- for message in messages -%}" + (_DEFAULT_SYSTEM_TURN if default_system_turn else "") + _TURN
            + "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


CHAT_TEMPLATE = chat_template(default_system_turn=True)

# (vision: embed dim, depth, heads; text: hidden, MLP intermediate, layers, heads, kv heads, M-RoPE sections
# (summing to half the head dim)) and the image processor's max pixels.
SIZES: dict[str, dict[str, Any]] = {
    # Unit tests: at most 12,544 px per frame after qwen-vl-utils' resize, e.g. 56 x 168 px for demo_test.mp4.
    "tiny": dict(embed_dim=32, depth=2, vision_heads=2, text_hidden=64, text_intermediate=160, text_layers=2,
                 text_heads=4, text_kv_heads=2, mrope_section=[2, 3, 3], max_pixels=112 * 112),
    # Tarsier2's decode-bound benchmark shape, so that the families' speed-ups compare: a ~100M-parameter LM behind
    # frames the processor brings to at most 50,176 px.
    "bench": TARSIER2_SIZES["bench"],
}


def build(out_dir: Path, size: str, seed: int, variant: Variant = QWEN2_VL_VARIANT) -> None:
    """Write a random-weight checkpoint of `variant` and `size` (a key of SIZES) into `out_dir`."""
    geometry = SIZES[size]
    ids, vocab = write_tokenizer(out_dir)
    raw = config_dict(variant, geometry, ids, vocab)
    write_json(out_dir / "config.json", raw)
    write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if variant.time_aligned else "Qwen2VLProcessor",
        "min_pixels": MIN_PIXELS, "max_pixels": geometry["max_pixels"], "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD})
    write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "repetition_penalty": REPETITION_PENALTY})
    torch.manual_seed(seed)
    model = QwenVLModel(QwenVLConfig.from_dict(raw, variant)).float()
    save_weights(model, out_dir, variant.checkpoint_key)


def write_tokenizer(out_dir: Path) -> tuple[dict[str, int], int]:
    """The Qwen2 tokenizer's files; the special tokens' ids, and the vocabulary the embeddings hold (rounded up)."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    write_tokenizer_config_for_older_readers(out_dir / "tokenizer_config.json")
    return {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}, round_up(len(tokenizer), 64)


def config_dict(variant: Variant, geometry: dict[str, Any], ids: dict[str, int], vocab: int) -> dict[str, Any]:
    """config.json as the published checkpoints lay it out: text settings flat, the vision tower nested."""
    text = {
        "vocab_size": vocab, "hidden_size": geometry["text_hidden"], "intermediate_size": geometry["text_intermediate"],
        "num_hidden_layers": geometry["text_layers"], "num_attention_heads": geometry["text_heads"],
        "num_key_value_heads": geometry["text_kv_heads"], "hidden_act": "silu", "max_position_embeddings": 32768,
        "max_window_layers": geometry["text_layers"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": geometry["mrope_section"]},
        "sliding_window": 32768, "use_sliding_window": False, "attention_dropout": 0.0,
        "initializer_range": INIT_SCALE, "use_cache": True,
        # Qwen2.5-VL-3B ties its output head to the embeddings; the tiny Qwen2.5-VL does, to cover that layout.
        "tie_word_embeddings": variant.time_aligned}
    tokens = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
              "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
              "video_token_id": ids["<|video_pad|>"]}
    common_vision = {"depth": geometry["depth"], "num_heads": geometry["vision_heads"], "in_chans": 3,
                     "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "initializer_range": INIT_SCALE}
    if variant.time_aligned:   # Qwen2.5-VL: RMSNorm + SwiGLU blocks, windows of 56 px here (112 in the 7B)
        vision = {**common_vision, "hidden_act": "silu", "hidden_size": geometry["embed_dim"],
                  "intermediate_size": 2 * geometry["embed_dim"], "out_hidden_size": geometry["text_hidden"],
                  "window_size": 56, "fullatt_block_indexes": [geometry["depth"] - 1], "tokens_per_second": 2}
    else:
        vision = {**common_vision, "embed_dim": geometry["embed_dim"], "hidden_size": geometry["text_hidden"],
                  "mlp_ratio": 4, "hidden_act": "quick_gelu"}
    return {"architectures": [f"{variant.config_class.__name__.removesuffix('Config')}ForConditionalGeneration"],
            "model_type": variant.model_type, **tokens, **text, "torch_dtype": "float32", "vision_config": vision}
