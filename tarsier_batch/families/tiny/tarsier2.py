"""Deterministic random-weight Tarsier2 checkpoints in the official on-disk layout.

The files of omni-research/Tarsier2-Recap-7b as the official code reads them: config.json
(`model_type "llava"`, flat Qwen2-VL text and vision sub-configs, with the `auto_map` entries the
official loader follows), model.safetensors under `vision_tower.` and `language_model.`, a
byte-level BPE tokenizer with the Qwen2-VL special tokens after its base vocabulary,
chat_template.json, processor_config.json, preprocessor_config.json (a Qwen2VLImageProcessor,
`size {min_pixels, max_pixels}` and the same values at the top level, which transformers 4.47
reads) and generation_config.json with a repetition penalty, so that path is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig, Qwen2VLVisionConfig

from ..tarsier2 import Tarsier2Config, Tarsier2Model
from ..weights import save_weights
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

# Qwen2-VL's special tokens, in their order (151643 onwards in the real vocabulary).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
REPETITION_PENALTY = 1.05  # what Qwen2-VL-7B-Instruct's generation_config.json carries

# A Qwen2-VL-style template consistent with what the official processor requires: media first
# as one vision block of `num_vision_tokens` image pads, then the text; the empty final
# assistant turn stays open when the caller passes `strip_final_eos`.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or content['type'] == 'video' -%}"
    "{{- '<|vision_start|>' + '<|image_pad|>' * content['num_vision_tokens'] + '<|vision_end|>' -}}"
    "{%- elif content['type'] == 'text' -%}"
    "{%- if message['role'] == 'assistant' -%}{% generation %}{{- content['text'] -}}{% endgeneration %}"
    "{%- else -%}{{- content['text'] -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if not (loop.last and strip_final_eos) -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen2-VL-7B-Instruct's preprocessor_config.json max_pixels: frames are then bounded by the
# official 460,800-px pre-resize, not by the image processor.
QWEN2_VL_MAX_PIXELS = 12_845_056

# (vision: embed dim, depth, heads; text: hidden, MLP intermediate, layers, heads, kv heads,
# M-RoPE sections (summing to half the head dim)) and the image processor's max pixels.
SIZES: dict[str, dict[str, Any]] = {
    # Unit tests: 12,544 px per frame at most, e.g. 56 x 168 px for demo_test.mp4, 12 vectors a frame.
    "tiny": dict(embed_dim=32, depth=2, vision_heads=2, text_hidden=64, text_intermediate=160, text_layers=2,
                 text_heads=4, text_kv_heads=2, mrope_section=[2, 3, 3], max_pixels=112 * 112),
    # The real pixel budget (460,800 px per frame before the processor; 608 vectors a frame for
    # demo_test.mp4) with a small language model.
    "small": dict(embed_dim=32, depth=2, vision_heads=2, text_hidden=128, text_intermediate=320, text_layers=2,
                  text_heads=4, text_kv_heads=2, mrope_section=[4, 6, 6], max_pixels=QWEN2_VL_MAX_PIXELS),
    # Decode-bound benchmarks: a ~100M-parameter LM (grouped-query attention like Tarsier2-7b,
    # head dim 128) behind frames of at most 50,176 px (224 x 224).
    "bench": dict(embed_dim=64, depth=2, vision_heads=2, text_hidden=1024, text_intermediate=3072, text_layers=8,
                  text_heads=8, text_kv_heads=2, mrope_section=[16, 24, 24], max_pixels=224 * 224),
    # The same LM at the official 460,800 px per frame.
    "wide": dict(embed_dim=64, depth=2, vision_heads=2, text_hidden=1024, text_intermediate=3072, text_layers=8,
                 text_heads=8, text_kv_heads=2, mrope_section=[16, 24, 24], max_pixels=QWEN2_VL_MAX_PIXELS),
    # Pruning benchmarks: a ~90M-parameter LM at Tarsier2-7b's depth (28 layers, head dim 128, grouped
    # queries) at the official pixel budget, so that "after layer K" leaves the real share of layers.
    "deep": dict(embed_dim=64, depth=2, vision_heads=2, text_hidden=512, text_intermediate=1536, text_layers=28,
                 text_heads=4, text_kv_heads=2, mrope_section=[16, 24, 24], max_pixels=QWEN2_VL_MAX_PIXELS),
}
MIN_PIXELS = 56 * 56


def build(out_dir: Path, size: str, seed: int) -> None:
    """Write a random-weight Tarsier2 checkpoint of `size` (a key of SIZES) into `out_dir`."""
    geometry = SIZES[size]
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    write_merges_as_strings(out_dir / "tokenizer.json")
    write_tokenizer_config_for_older_readers(out_dir / "tokenizer_config.json")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    raw = _config_dict(geometry, ids, vocab=round_up(len(tokenizer), 64))
    write_json(out_dir / "config.json", raw)
    write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out_dir / "processor_config.json", {
        "processor_class": "TarsierProcessor", "image_token": "<|image_pad|>", "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "max_seq_len": 8192})
    write_json(out_dir / "preprocessor_config.json", _preprocessor_dict(geometry["max_pixels"]))
    write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "repetition_penalty": REPETITION_PENALTY})
    torch.manual_seed(seed)
    model = Tarsier2Model(Tarsier2Config.from_dict(raw)).float()
    save_weights(model, out_dir)


def build_tokenizer() -> PreTrainedTokenizerBase:
    """A Qwen2-style byte-level BPE trained on the built-in text, then the Qwen2-VL special tokens."""
    trainer_model = Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer_model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trainer_model.train_from_iterator(TRAINING_TEXT.strip().splitlines(), trainer)
    model = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.eos_token = "<|im_end|>"  # as in Qwen2-VL's tokenizer_config.json
    return tokenizer


def write_tokenizer_config_for_older_readers(path: Path) -> None:
    """Name the special tokens as transformers 4.x does (`additional_special_tokens`), as the real files do."""
    config = json.loads(path.read_text())
    config.pop("backend", None)
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    write_json(path, config)


def _config_dict(geometry: dict[str, Any], ids: dict[str, int], vocab: int) -> dict[str, Any]:
    text = Qwen2VLTextConfig(
        vocab_size=vocab, hidden_size=geometry["text_hidden"], intermediate_size=geometry["text_intermediate"],
        num_hidden_layers=geometry["text_layers"], num_attention_heads=geometry["text_heads"],
        num_key_value_heads=geometry["text_kv_heads"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        initializer_range=INIT_SCALE, tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": geometry["mrope_section"]})
    vision = Qwen2VLVisionConfig(
        depth=geometry["depth"], embed_dim=geometry["embed_dim"], hidden_size=geometry["text_hidden"],
        num_heads=geometry["vision_heads"], mlp_ratio=4, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, initializer_range=INIT_SCALE)
    text_raw = {key: value for key, value in plain_config(text).items()
                if key not in ("rope_parameters", "dtype", "layer_types")}
    # The official Qwen2-VL config (transformers 4.47 and the official modeling file) reads rope_scaling.
    text_raw.update({
        "model_type": "qwen2_vl", "rope_scaling": {"type": "mrope", "mrope_section": geometry["mrope_section"]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "attn_implementation": "flash_attention_2",
        "auto_map": {"AutoConfig": "models--modeling_qwen2_vl_fast.Qwen2VLConfig"}})
    vision_raw = {key: value for key, value in plain_config(vision).items() if key not in ("rope_parameters", "dtype")}
    vision_raw.update({
        "model_type": "qwen2_vl", "attn_implementation": "flash_attention_2",
        "auto_map": {"AutoConfig": "models--modeling_qwen2_vl_fast.Qwen2VLVisionConfig",
                     "AutoModel": "models--modeling_qwen2_vl_fast.Qwen2VisionTransformerPretrainedModel"}})
    return {
        "architectures": ["TarsierForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": ids["<|image_pad|>"],
        "projection_head": None,  # Qwen2-VL's patch merger is the projector: no separate one, no weights
        "vocab_size": vocab,
        "torch_dtype": "float32",
        "vision_config": vision_raw,
        "text_config": text_raw,
    }


def _preprocessor_dict(max_pixels: int) -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "TarsierProcessor",
        "min_pixels": MIN_PIXELS,
        "max_pixels": max_pixels,
        "size": {"min_pixels": MIN_PIXELS, "max_pixels": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "do_convert_rgb": True,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
