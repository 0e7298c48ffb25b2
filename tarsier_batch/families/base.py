"""The interface between model families and the engine.

A family is split in two, so that CPU work can run in loader threads (and, later, worker
processes) while the weights stay on the device:

- a `Processor` (CPU, picklable results): media + instruction -> `ProcessedPrompt`, the merged
  prompt laid out position by position, with the pixels of each vision block;
- a `CaptionModel` (device): encodes vision blocks, embeds tokens, and runs the language model
  over new tokens given an `Attention` callback that owns the KV cache.

The engine only sees these types. It never learns which family it runs, and a family never
learns how its rows are batched, chunked or cached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ..media import MAX_IMAGE_PIXELS, FrameCount, Media, MediaType, Span
from .catalog import FamilyInfo


@dataclass(frozen=True)
class VisionBlock:
    """A unit the vision encoder turns into `length` consecutive prompt vectors (a frame).

    A block is always encoded whole; a prefill chunk may still take only part of its vectors.
    """

    start: int   # position in the merged prompt of the block's first vector
    length: int  # vectors the block puts in the prompt
    grid: tuple[int, int, int] | None = None  # the encoder's (t, h, w) patch grid, where frames vary in size
    # With temporal pruning (`families.temporal`): which of the encoder's vectors for the block those are, in order.
    kept: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        return self.start + self.length

    def prompt_vectors(self, encoded: torch.Tensor) -> torch.Tensor:
        """The block's vectors in the prompt, from all the encoder made of it (`CaptionModel.encode_vision`)."""
        if self.kept is None:
            return encoded
        # long even when empty: a frame that repeats the one before may keep none of its vectors
        return encoded[torch.tensor(self.kept, dtype=torch.long, device=encoded.device)]


class PixelDigests(NamedTuple):
    """A digest of each vision block's pixels (what the vision encoder turns into its vectors), and the pixels."""

    of: torch.Tensor
    digests: tuple[bytes, ...]


@dataclass
class ProcessedPrompt:
    """One item's merged prompt, ready for the engine; made on the CPU, holds no device tensors.

    `token_ids` has one id per merged position: text positions hold their token, positions
    covered by a vision block hold a placeholder id whose embedding is replaced by the block's
    vectors. `positions` has a leading axis of position components (1 for Llama's 1-D RoPE,
    3 for Qwen2-VL's M-RoPE).
    """

    instruction: str
    token_ids: torch.Tensor       # (length,) int64
    positions: torch.Tensor       # (components, length) int64
    next_position: int            # position of the first generated token
    vision_blocks: list[VisionBlock]
    pixel_values: torch.Tensor    # (blocks, ...) the encoder's input for each block, float32
    # A digest of each block's pixels, made where the pixels are (`digest_pixels`, in a decoding worker) rather
    # than in the engine's loop; made when first needed if missing or of other pixels (a copy made with other
    # `pixel_values` carries the old ones).
    pixel_digests: PixelDigests | None = None

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    def page_digests(self, page_slots: int) -> list[bytes]:
        """One digest per full page of `page_slots` positions of the prompt, of everything the page's keys and
        values depend on: its ids and positions, the vectors its vision positions take (which block, by its
        pixels and layout, and which of the block's vectors), and, chained, every page before it. Two prompts
        whose first n digests are equal compute their first n pages alike, so one may take the other's."""
        pixels = self.digest_pixels().digests if self.vision_blocks else ()
        blocks = [(block, hashlib.sha256(repr((block.length, block.grid, block.kept)).encode() + digest).digest())
                  for block, digest in zip(self.vision_blocks, pixels)]
        digests, previous = [], b""
        for first in range(0, self.length - page_slots + 1, page_slots):
            last = first + page_slots
            page = hashlib.sha256(previous)
            page.update(self.token_ids[first:last].numpy().tobytes())
            page.update(self.positions[:, first:last].numpy().tobytes())
            for block, digest in blocks:
                if block.start < last and block.end > first:
                    page.update(digest + repr((max(first, block.start) - block.start,
                                               min(last, block.end) - block.start)).encode())
            previous = page.digest()
            digests.append(previous)
        return digests

    def digest_pixels(self) -> PixelDigests:
        """The digests of this prompt's pixels, made now unless made already."""
        if self.pixel_digests is None or self.pixel_digests.of is not self.pixel_values:
            # SHA-256: the fastest of hashlib's where CPUs hash it in hardware (1.2 GB/s here, blake2b 0.45).
            self.pixel_digests = PixelDigests(self.pixel_values, tuple(
                hashlib.sha256(block.contiguous().numpy().data).digest() for block in self.pixel_values))
        return self.pixel_digests

    def shared_prefix(self, other: ProcessedPrompt) -> int:
        """How many leading positions `other` computes exactly as this prompt does: the same ids at the same
        positions, and in vision blocks the same vectors (questions about one clip share everything before
        their instructions). At most `other.length - 1`: its last position must be computed to sample."""
        limit = min(self.length, other.length - 1)
        differs = ((self.token_ids[:limit] != other.token_ids[:limit])
                   | (self.positions[:, :limit] != other.positions[:, :limit]).any(dim=0))
        shared = int(differs.int().argmax()) if bool(differs.any()) else limit
        for index, (mine, theirs) in enumerate(zip(self.vision_blocks, other.vision_blocks)):
            if mine.start >= shared:
                break
            if mine != theirs or not (self.pixel_values is other.pixel_values
                                      or torch.equal(self.pixel_values[index], other.pixel_values[index])):
                return mine.start
        return shared


class Attention(Protocol):
    """What a model calls in each layer: store the new keys and values, attend over each row's context.

    Shapes are flattened over the step's rows: q (tokens, heads, head_dim), k and v
    (tokens, kv_heads, head_dim), all already rotated. Returns (tokens, heads, head_dim).
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class LargestItem:
    """Bounds on one item's prompt: its vision positions, and its preprocessed pixels' bytes."""

    vision_positions: int
    pixel_bytes: int


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's keys and values, to size the engine's cache."""

    num_layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype.itemsize


class Processor(Protocol):
    """CPU side: turns media into a `ProcessedPrompt`; picklable (it runs in decoding worker processes)."""

    default_frames: int  # frames sampled from a video when the user does not say

    def load_media(self, path: str, media_type: MediaType, num_frames: FrameCount,
                   max_image_pixels: int | None = MAX_IMAGE_PIXELS, span: Span | None = None) -> Media:
        """Decode and sample a file (or, with `span`, a stretch of a video) the family's way; each frame is
        preprocessed as soon as it is decoded."""

    def process(self, media: Media, instruction: str | None) -> ProcessedPrompt:
        """`media` from `load_media`; `instruction` None means the family's default for the media type."""

    def min_vision_positions(self, num_frames: int) -> int:
        """The fewest vision positions an item of `num_frames` frames can take (to reject impossible --frames)."""

    def largest_item(self, num_frames: int) -> LargestItem:
        """The most an item of `num_frames` frames can take (to estimate a run's memory before loading)."""

    def vision_changes(self, prompt: ProcessedPrompt) -> list[torch.Tensor | None]:
        """Per vision block, how much each of its encoder vectors changed since the previous frame (see
        `families.temporal`)."""


class CaptionModel(Protocol):
    """Device side: a loaded checkpoint."""

    family: FamilyInfo
    processor: Processor
    eos_token_ids: frozenset[int]
    repetition_penalty: float      # the checkpoint's generation_config.json value (1.0: none)
    dtype: torch.dtype
    device: torch.device
    kv_geometry: KVGeometry

    def encode_vision(self, pixels: list[torch.Tensor], blocks: list[VisionBlock]) -> list[torch.Tensor]:
        """Every vector the encoder makes of each block, (vectors, hidden) each, or wider where they carry inputs
        for later layers (`widened`), from each block's encoder input (all of them, also where the prompt keeps
        fewer: `VisionBlock.prompt_vectors`)."""

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) ids -> (tokens, hidden) input vectors."""

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Run (tokens, hidden) vectors (or wider: `widened`) at `positions` (components, tokens); returns final
        hidden states."""

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, attention: Attention, first: int,
                   end: int) -> torch.Tensor:
        """Run (tokens, hidden) inputs of layer `first` through layers [first, end); returns layer `end`'s inputs
        (`forward` is all layers, then `final_norm`)."""

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's outputs -> final hidden states."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) final hidden states -> (rows, vocab) next-token logits."""

    def decode(self, token_ids: list[int]) -> str:
        """Caption text for generated ids."""

    def compile(self) -> None:
        """Run the language model's layers through torch.compile from now on."""


def widened(embeds: torch.Tensor, width: int) -> torch.Tensor:
    """Token embeddings (tokens, hidden) widened with zeros to the vision vectors' `width`.

    A model whose vision vectors carry inputs for later layers (Qwen3-VL's DeepStack features, appended along the
    hidden axis) adds those columns to every token's hidden state there: zeros leave text positions as they are.
    """
    extra = width - embeds.shape[1]
    return torch.nn.functional.pad(embeds, (0, extra)) if extra > 0 else embeds


def embed_whole_prompt(model: CaptionModel, prompt: ProcessedPrompt) -> torch.Tensor:
    """All of a prompt's input vectors at once, (length, hidden or wider, see `widened`): what the official code
    feeds its language model, and what references and baselines compare the engine's chunked prefill to."""
    with torch.inference_mode():
        embeds = model.embed_tokens(prompt.token_ids.to(model.device)).clone()
        vectors = model.encode_vision(list(prompt.pixel_values), prompt.vision_blocks)
        if vectors:
            embeds = widened(embeds, vectors[0].shape[1])
        for block, block_vectors in zip(prompt.vision_blocks, vectors):
            embeds[block.start:block.end] = block.prompt_vectors(block_vectors)
    return embeds
