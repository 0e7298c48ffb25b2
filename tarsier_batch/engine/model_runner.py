"""Turn a scheduled step into tensors, run the model once, and return the logits rows need.

Vision vectors are produced only when a chunk reaches them: the blocks a step touches are
encoded together (in micro-batches), kept on their sequence until a chunk has consumed their
last vector, then dropped. So a long video never holds all its vision vectors at once.
"""

from __future__ import annotations

import torch

from ..families.base import CaptionModel
from .attention import RowSpan, StepAttention
from .kv_cache import KVCache
from .scheduler import ScheduledRow
from .sequence import Sequence

VISION_BLOCKS_PER_CALL = 16  # bounds the vision tower's activations in one call


class ModelRunner:
    def __init__(self, model: CaptionModel, kv: KVCache):
        self.model = model
        self.kv = kv

    @torch.inference_mode()
    def run(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute the step; returns the rows that reached their last position and their logits."""
        self._encode_vision(step)
        embeds, positions, spans, sampled_at, sampled = [], [], [], [], []
        offset = 0
        for row in step:
            seq, start = row.seq, row.seq.num_computed
            end = start + row.num_tokens
            embeds.append(self._embed(seq, start, end))
            positions.append(seq.positions(start, end))
            spans.append(RowSpan(offset, row.num_tokens, start, seq.region, seq.host_kv))
            offset += row.num_tokens
            if end == seq.length:
                sampled.append(seq)
                sampled_at.append(offset - 1)
        device = self.model.device
        attention = StepAttention(self.kv, spans, device)
        hidden = self.model.forward(torch.cat(embeds), torch.cat(positions, dim=1).to(device), attention)
        self._drop_consumed_vision(step)
        if not sampled:
            return [], None
        return sampled, self.model.logits(hidden[torch.tensor(sampled_at, device=device)])

    def _embed(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Input vectors of positions [start, end): token embeddings, vision vectors where blocks lie."""
        embeds = self.model.embed_tokens(seq.token_ids(start, end).to(self.model.device))
        for index, block in enumerate(seq.prompt.vision_blocks):
            first, last = max(start, block.start), min(end, block.end)
            if first >= last:
                continue
            vectors = seq.encoded[index]
            embeds[first - start:last - start] = vectors[first - block.start:last - block.start]
        return embeds

    @staticmethod
    def _drop_consumed_vision(step: list[ScheduledRow]) -> None:
        """Free the vectors of blocks whose last vector the step consumed (only once it succeeded)."""
        for row in step:
            end = row.seq.num_computed + row.num_tokens
            for index, block in enumerate(row.seq.prompt.vision_blocks):
                if block.end <= end:
                    row.seq.encoded.pop(index, None)

    def _encode_vision(self, step: list[ScheduledRow]) -> None:
        """Encode every vision block the step's chunks reach that is not encoded yet."""
        wanted: list[tuple[Sequence, int]] = []
        for row in step:
            seq, start = row.seq, row.seq.num_computed
            end = start + row.num_tokens
            wanted += [(seq, index) for index, block in enumerate(seq.prompt.vision_blocks)
                       if block.start < end and block.end > start and index not in seq.encoded]
        for first in range(0, len(wanted), VISION_BLOCKS_PER_CALL):
            batch = wanted[first:first + VISION_BLOCKS_PER_CALL]
            vectors = self.model.encode_vision([seq.prompt.pixel_values[index] for seq, index in batch],
                                               [seq.prompt.vision_blocks[index] for seq, index in batch])
            for (seq, index), block_vectors in zip(batch, vectors):
                seq.encoded[index] = block_vectors
