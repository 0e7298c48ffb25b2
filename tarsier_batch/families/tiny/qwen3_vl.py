"""Deterministic random-weight Qwen3-VL checkpoints in the published on-disk layout.

The files of Qwen/Qwen3-VL-8B-Instruct: config.json with a nested `text_config` (`rope_scaling` with
`mrope_section` and `mrope_interleaved`, query and key norms) and `vision_config` (16-px patches, DeepStack
layers), model.safetensors under `model.visual.`, `model.language_model.` and `lm_head.`, the Qwen2 byte-level
BPE tokenizer with the vision special tokens, preprocessor_config.json (a Qwen2VLImageProcessor of 16-px patches,
mean and std 0.5), chat_template.json (no default system turn; each image or video as <|vision_start|> + one pad
token + <|vision_end|>) and generation_config.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..qwen2_vl import QwenVLConfig, QwenVLModel
from ..qwen3_vl import QWEN3_VL_VARIANT
from ..weights import save_weights
from .common import INIT_SCALE
from .qwen2_vl import chat_template, write_tokenizer
from .tarsier2 import write_json

CHAT_TEMPLATE = chat_template(default_system_turn=False)
PROCESSOR_MEAN_STD = [0.5, 0.5, 0.5]

# Three decoder layers, two of them taking DeepStack features (from vision blocks 0 and 1), so that one takes
# none; M-RoPE sections of the 16-dim heads' 8 frequencies, interleaved T H W T H W T T (the 8B: [24, 20, 20]).
SIZES: dict[str, dict[str, Any]] = {
    # Unit tests: at most 16,384 px per frame after the image processor, e.g. 64 x 192 px for demo_test.mp4.
    "tiny": dict(embed_dim=32, depth=3, vision_heads=2, deepstack=[0, 1], text_hidden=64, text_intermediate=128,
                 text_layers=3, text_heads=4, text_kv_heads=2, head_dim=16, mrope_section=[4, 2, 2],
                 max_pixels=128 * 128),
    # The Qwen families' benchmark shape: Qwen2-VL's `bench` language model (the 8B's head dim and M-RoPE sections)
    # behind frames of at most 65,536 px, the same 64 merged patches a frame as Qwen2-VL's 50,176 px at 14-px patches.
    "bench": dict(embed_dim=64, depth=2, vision_heads=2, deepstack=[0, 1], text_hidden=1024, text_intermediate=3072,
                  text_layers=8, text_heads=8, text_kv_heads=2, head_dim=128, mrope_section=[24, 20, 20],
                  max_pixels=256 * 256),
}


def build(out_dir: Path, size: str, seed: int) -> None:
    """Write a random-weight Qwen3-VL checkpoint of `size` (a key of SIZES) into `out_dir`."""
    geometry = SIZES[size]
    ids, vocab = write_tokenizer(out_dir)
    raw = config_dict(geometry, ids, vocab)
    write_json(out_dir / "config.json", raw)
    write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": 64 * 64, "longest_edge": geometry["max_pixels"]}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": PROCESSOR_MEAN_STD,
        "image_std": PROCESSOR_MEAN_STD})
    write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": True, "temperature": 0.7,
        "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.0})
    torch.manual_seed(seed)
    model = QwenVLModel(QwenVLConfig.from_dict(raw, QWEN3_VL_VARIANT)).float()
    save_weights(model, out_dir, QWEN3_VL_VARIANT.checkpoint_key)


def config_dict(geometry: dict[str, Any], ids: dict[str, int], vocab: int) -> dict[str, Any]:
    """config.json as the published checkpoints lay it out: the text and vision settings nested."""
    text = {
        "model_type": "qwen3_vl_text", "vocab_size": vocab, "hidden_size": geometry["text_hidden"],
        "intermediate_size": geometry["text_intermediate"], "num_hidden_layers": geometry["text_layers"],
        "num_attention_heads": geometry["text_heads"], "num_key_value_heads": geometry["text_kv_heads"],
        "head_dim": geometry["head_dim"], "hidden_act": "silu", "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": geometry["mrope_section"],
                         "mrope_interleaved": True},
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": INIT_SCALE, "use_cache": True,
        "tie_word_embeddings": False, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "dtype": "float32"}
    vision = {
        "model_type": "qwen3_vl", "depth": geometry["depth"], "hidden_size": geometry["embed_dim"],
        "intermediate_size": 2 * geometry["embed_dim"], "num_heads": geometry["vision_heads"],
        "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": geometry["text_hidden"], "num_position_embeddings": 64,
        "deepstack_visual_indexes": geometry["deepstack"], "initializer_range": INIT_SCALE}
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "tie_word_embeddings": False, "text_config": text, "vision_config": vision}
