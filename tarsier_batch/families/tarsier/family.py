"""Tarsier v1 behind the `CaptionModel` interface."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Cache, DynamicCache

from ...engine import PromptEmbedding
from ...media import Media
from ..base import PreparedInput
from .modeling import TarsierConfig
from .processing import TarsierProcessor, build_prompt, default_instruction
from .weights import load_model

VISION_CHUNK_FRAMES = 32  # frames per vision-tower call, bounding its activation memory
PROMPT_TEXT_TOKENS = 64   # a generous allowance for the text around the frames


def merge_frame_features(prompt_ids: torch.Tensor, frame_features: torch.Tensor,
                         token_embeds: torch.Tensor, image_token_index: int) -> PromptEmbedding:
    """Replace the i-th image placeholder by frame i's vectors; positions run 0..L-1.

    prompt_ids: (tokens,), frame_features: (frames, tokens_per_frame, hidden),
    token_embeds: (tokens, hidden), the LM embeddings of `prompt_ids`.
    """
    slots = (prompt_ids == image_token_index).nonzero().flatten().tolist()
    if len(slots) != frame_features.shape[0]:
        raise ValueError(f"prompt has {len(slots)} image placeholders for {frame_features.shape[0]} frames")
    pieces, start = [], 0
    for frame, slot in enumerate(slots):
        pieces += [token_embeds[start:slot], frame_features[frame]]
        start = slot + 1
    pieces.append(token_embeds[start:])
    embeds = torch.cat(pieces)
    return PromptEmbedding(embeds, torch.arange(embeds.shape[0], device=embeds.device))


class TarsierCaptioner:
    """A Tarsier v1 checkpoint loaded for captioning."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.config = TarsierConfig.from_file(model_dir / "config.json")
        self.processor = TarsierProcessor(model_dir)
        self.model = load_model(model_dir, self.config, dtype, device)
        self.dtype, self.device = dtype, device
        self.eos_token_ids = _eos_token_ids(model_dir, self.processor.tokenizer.eos_token_id)

    def prepare(self, media: Media, instruction: str | None) -> PreparedInput:
        text = instruction if instruction is not None else default_instruction(media.media_type)
        prompt = build_prompt(len(media.frames), text)
        return PreparedInput(text, self.processor.prompt_ids(prompt), self.processor.pixel_values(media.frames))

    @torch.inference_mode()
    def embed_prompts(self, inputs: list[PreparedInput]) -> list[PromptEmbedding]:
        pixels = torch.cat([item.pixel_values for item in inputs]).to(self.device, self.dtype)
        features = torch.cat([self.model.frame_features(chunk)
                              for chunk in pixels.split(VISION_CHUNK_FRAMES)])
        per_item = features.split([item.pixel_values.shape[0] for item in inputs])
        prompts = []
        for item, frame_features in zip(inputs, per_item):
            ids = torch.tensor(item.prompt_ids, device=self.device)
            prompts.append(merge_frame_features(ids, frame_features, self.embed_tokens(ids),
                                                self.config.image_token_index))
        return prompts

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.get_input_embeddings()(token_ids)

    def new_cache(self) -> Cache:
        return DynamicCache(config=self.config.text)

    def forward_step(self, embeds: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        output = self.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                           position_ids=position_ids, past_key_values=cache,
                                           use_cache=True, logits_to_keep=1)
        return output.logits[:, -1]

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.decode(token_ids)

    def estimated_prompt_tokens(self, frames: int) -> int:
        return frames * self.config.tokens_per_frame + PROMPT_TEXT_TOKENS

    def kv_bytes_per_token(self) -> int:
        text = self.config.text
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = text.num_key_value_heads or text.num_attention_heads
        return 2 * text.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize


def _eos_token_ids(model_dir: Path, tokenizer_eos: int | None) -> frozenset[int]:
    """Stop tokens: the checkpoint's generation_config.json if it names any, else the tokenizer's `</s>`."""
    ids: set[int] = set()
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    if not ids:
        raise ValueError(f"{model_dir} names no end-of-sequence token")
    return frozenset(ids)
