"""The Qwen2-VL vision tower's blocks, run the way the engine wants them: every frame's attention in one call
per frame size, and the work around it in two halves that `--compile` fuses.

transformers' block (with SDPA) splits the patches frame by frame at every layer: it reads the frame lengths
back from the device (the host waits, 32 times a tower call) and launches one attention per frame. The official
code's flash-attention computes the same block-diagonal attention in one varlen call. Here frames of one size
are one batch of SDPA (a block cannot attend across frames: each attends within itself), their lengths come
from the host, and the norms, the rotary embedding (float32, as transformers computes it), the projections and
the MLP use transformers' own modules and functions, so the arithmetic is transformers'.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionBlock, apply_rotary_pos_emb_vision

from ..decoder import LayerSteps


def block_attention_inputs(block: nn.Module, hidden: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block up to its attention: (patches, embed) -> rotated queries and keys, and values, each
    (patches, heads, head_dim)."""
    attn, patches = block.attn, hidden.shape[0]
    q, k, v = attn.qkv(block.norm1(hidden)).reshape(patches, 3, attn.num_heads, -1).unbind(1)
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    return q, k, v


def block_outputs(block: nn.Module, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """A block after its attention: the output projection, the residuals and the MLP."""
    hidden = hidden + block.attn.proj(attended)
    return hidden + block.mlp(block.norm2(hidden))


# A block's two halves around its attention; `BLOCK_STEPS.compiled()` for `--compile`: one compilation for
# every block and every number of patches.
BLOCK_STEPS = LayerSteps(block_attention_inputs, block_outputs)


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, frame_lengths: Sequence[int],
                    scale: float) -> torch.Tensor:
    """Each frame's patches attending to that frame's alone: (patches, heads, head_dim) each -> (patches,
    heads * head_dim). Consecutive frames of one length are one batch."""
    outputs, start = [], 0
    for length, run in itertools.groupby(frame_lengths):
        frames = len(list(run))
        frames_q, frames_k, frames_v = (_as_frames(x, start, frames, length) for x in (q, k, v))
        attended = F.scaled_dot_product_attention(frames_q, frames_k, frames_v, scale=scale)
        outputs.append(attended.transpose(1, 2).reshape(frames * length, -1))
        start += frames * length
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _as_frames(x: torch.Tensor, start: int, frames: int, length: int) -> torch.Tensor:
    """`frames` consecutive frames of `length` patches from patch `start` of (patches, heads, d): (frames, heads,
    length, d), a view."""
    return x[start:start + frames * length].view(frames, length, *x.shape[1:]).transpose(1, 2)


class FrameBatchedVisionBlock(Qwen2VLVisionBlock):
    """transformers' vision block (same modules, same weights) whose forward batches the frames' attention.

    The tower's forward passes its keyword arguments on to every block: `frame_lengths` (patches per frame, in
    order) comes that way from the caller; without it (transformers' own generate, in the baselines) the
    lengths are read from `cu_seqlens`."""

    steps: LayerSteps = BLOCK_STEPS

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                frame_lengths: Sequence[int] | None = None, **kwargs: Any) -> torch.Tensor:
        if position_embeddings is None:
            raise ValueError("the vision block needs the tower's position_embeddings (cos, sin)")
        if frame_lengths is None:
            frame_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        cos, sin = position_embeddings
        q, k, v = self.steps.attention_inputs(self, hidden_states, cos, sin)
        return self.steps.layer_outputs(self, hidden_states, frame_attention(q, k, v, frame_lengths, self.attn.scaling))

