"""A forward pass through transformers' decoder layers with the engine's attention and KV cache.

transformers' own forward owns its cache and padding; the engine needs tokens of many rows,
flattened, attending through its `Attention` callback. This loop reuses every module of the
layer (norms, projections, MLP) and replaces only the attention plumbing, so the arithmetic is
the same as transformers' for Llama-style layers (Llama; Qwen2 with its q/k/v biases; Qwen3 with its
query and key norms).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx.experimental._config as shape_config
from torch import nn

from .base import Attention


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (tokens, heads, head_dim) vectors with (tokens, head_dim) cos and sin."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated_half * sin.unsqueeze(1)


def attention_inputs(layer: nn.Module, hidden: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to its attention: (tokens, hidden) -> rotated queries and keys, and values,
    (tokens, heads, head_dim) each."""
    attn, tokens = layer.self_attn, hidden.shape[0]
    normed = layer.input_layernorm(hidden)
    q = attn.q_proj(normed).view(tokens, -1, attn.head_dim)
    k = attn.k_proj(normed).view(tokens, -1, attn.head_dim)
    v = attn.v_proj(normed).view(tokens, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):   # Qwen3: each head's queries and keys RMS-normed before they rotate
        q, k = attn.q_norm(q), attn.k_norm(k)
    # Queries and keys rotate as one tensor: the same arithmetic per element, half the kernels.
    q, k = rotate(torch.cat([q, k], dim=1), cos, sin).split([q.shape[1], k.shape[1]], dim=1)
    return q, k, v


def layer_outputs(layer: nn.Module, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """A layer after its attention: the output projection, the residuals and the MLP."""
    hidden = hidden + layer.self_attn.o_proj(attended.reshape(hidden.shape[0], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


class LayerSteps(NamedTuple):
    """The two halves of a layer around its attention (a decoder layer's by default), eager or compiled."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attention_inputs
    layer_outputs: Callable[..., torch.Tensor] = layer_outputs

    def compiled(self) -> LayerSteps:
        """Both halves through torch.compile: every layer runs the same code with its own weights as inputs, so
        one compilation serves all layers, and every row count (`compile_for_any_sizes`)."""
        return LayerSteps(*(compile_for_any_sizes(step) for step in self))


def compile_for_any_sizes(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` through torch.compile with every size a symbol, so that one compilation serves every step.

    Sizes that happen to be equal stay apart (torch's "duck sizing" off while it compiles): with it, a first
    call whose page window equals the head dimension, or whose tokens equal the rows, would tie the two, and
    every later step where they differ would compile again, until torch's limit of recompilations sends the
    function back to eager without a word. The setting is read when a call compiles; set around each call, it
    costs ~8 us."""
    compiled = torch.compile(function, dynamic=True)

    @functools.wraps(function)
    def run(*args: Any) -> Any:
        duck_sizing = shape_config.use_duck_shape
        shape_config.use_duck_shape = False
        try:
            return compiled(*args)
        finally:
            shape_config.use_duck_shape = duck_sizing

    return run


def run_decoder_layers(layers: nn.ModuleList, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attention: Attention, first: int = 0, steps: LayerSteps = LayerSteps()) -> torch.Tensor:
    """(tokens, hidden) through `layers`, the decoder's layers from number `first` on (the number
    attention is told); `cos`/`sin` are each token's rotary factors."""
    for index, layer in enumerate(layers, start=first):
        q, k, v = steps.attention_inputs(layer, hidden, cos, sin)
        hidden = steps.layer_outputs(layer, hidden, attention(index, q, k, v, layer.self_attn.scaling))
    return hidden


class DecoderCaptionModel:
    """The language-model half shared by the families: `self.model.language_model` holds a
    transformers decoder (`.model`: embeddings, rotary embedding, layers, norm) and `.lm_head`."""

    model: nn.Module
    processor: Any
    layer_steps: LayerSteps = LayerSteps()

    def compile(self) -> None:
        """Run the language model's layers compiled from now on (`--compile`)."""
        self.layer_steps = LayerSteps().compiled()

    def rotary_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """The engine's (components, tokens) positions as the decoder's rotary embedding takes them."""
        return positions

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.model.embed_tokens(token_ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        decoder = self.model.language_model.model
        return decoder.norm(self.run_layers(embeds, positions, attention, 0, len(decoder.layers)))

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, attention: Attention, first: int,
                   end: int) -> torch.Tensor:
        decoder = self.model.language_model.model
        cos, sin = decoder.rotary_emb(hidden, self.rotary_position_ids(positions))  # (1, tokens, head_dim) each
        return run_decoder_layers(decoder.layers[first:end], hidden, cos[0], sin[0], attention, first,
                                  self.layer_steps)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.model.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.lm_head(hidden)

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.decode(token_ids)
