"""Turn a scheduled step into tensors, run the model once, and return the logits rows need.

Vision vectors are produced only when a chunk reaches them: the blocks a step touches are
encoded together (in micro-batches), kept on their sequence until a chunk has consumed their
last vector, then dropped. So a long video never holds all its vision vectors at once.
"""

from __future__ import annotations

import torch

from ..families.base import CaptionModel
from .attention import RowSpan, StepAttention
from .kv_cache import KVCache, Region
from .pruning import attention_of_last_query, choose_survivors
from .scheduler import ScheduledRow
from .sequence import Sequence

VISION_BLOCKS_PER_CALL = 16  # bounds the vision tower's activations in one call


class ModelRunner:
    def __init__(self, model: CaptionModel, pools: list[KVCache]):
        """`pools`: one cache of every layer, or (pruning) the layers before K's and the layers from K on's."""
        self.model = model
        self.pools = pools

    @torch.inference_mode()
    def run(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute the step; returns the rows that reached their last position and their logits."""
        self._encode_vision(step)
        if len(self.pools) > 1:
            sampled, hidden = self._run_in_two_parts(step)
        else:
            sampled, hidden = self._run_whole(step)
        self._drop_consumed_vision(step)
        if not sampled:
            return [], None
        return sampled, self.model.logits(hidden)

    def _run_whole(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor]:
        """Every row's new positions through every layer; the final hidden states of the rows that sample."""
        embeds, positions, spans, sampled_at, sampled = [], [], [], [], []
        offset = 0
        for row in step:
            seq, start = row.seq, row.seq.num_computed
            end = start + row.num_tokens
            embeds.append(self._embed(seq, start, end))
            positions.append(seq.positions(start, end))
            spans.append(RowSpan(offset, row.num_tokens, start, seq.regions[0] if seq.regions else None,
                                 seq.host_kv))
            offset += row.num_tokens
            if end == seq.length:
                sampled.append(seq)
                sampled_at.append(offset - 1)
        device = self.model.device
        attention = StepAttention(self.pools[0], spans, device)
        hidden = self.model.forward(torch.cat(embeds), torch.cat(positions, dim=1).to(device), attention)
        if not sampled:
            return [], hidden
        return sampled, hidden[torch.tensor(sampled_at, device=device)]

    def _run_in_two_parts(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor]:
        """Layers [0, K) then [K, end), each part with its own cache, when rows may be pruned (see
        `engine.pruning`).

        Rows not pruned and generated tokens go through both parts; a pruned row's prompt chunk
        only through the first (its layer-K inputs are kept), its survivors' chunk only through
        the second. Each part attends with its own slot offsets: in the late layers' cache a pruned
        row holds its survivors, then its generated tokens.
        """
        device = self.model.device
        early_pool, late_pool = self.pools
        layer = late_pool.layers.start
        early = _Part()
        late = _Part()
        early_outputs: list[tuple[Sequence, int, int, int]] = []   # (seq, offset in early part, start, end)
        scored: dict[int, Sequence] = {}                            # early span index -> row scored this step
        late_inputs: list[tuple[int, torch.Tensor | int]] = []       # per late span: its inputs, or its early offset
        sampled, sampled_at = [], []
        for row in step:
            seq, start = row.seq, row.seq.num_computed
            end = start + row.num_tokens
            pruning, prompt = seq.pruning, seq.prompt.length
            if pruning is not None and end <= prompt:              # the prompt through the early layers
                early_outputs.append((seq, early.tokens, start, end))
                if end == prompt and pruning.survivors is None:
                    scored[len(early.spans)] = seq
                early.add(self._embed(seq, start, end), seq.positions(start, end), start, seq.regions[0])
                continue
            if pruning is not None and end <= prompt + pruning.num_survivors:   # survivors through the late layers
                assert pruning.survivors is not None and pruning.layer_inputs is not None
                chosen = pruning.survivors[start - prompt:end - prompt]
                late_inputs.append((len(late.spans), pruning.layer_inputs[chosen.to(device)]))
                late.add(None, seq.prompt.positions[:, chosen], start - prompt, seq.regions[1], row.num_tokens)
            else:   # a row not pruned, or generated tokens: both parts; late slots after the survivors
                survivors = pruning.num_survivors if pruning is not None else 0
                real_start, real_end = start - survivors, end - survivors
                late_inputs.append((len(late.spans), early.tokens))
                early.add(self._embed(seq, real_start, real_end), seq.positions(real_start, real_end), real_start,
                          seq.regions[0])
                late_start = start - prompt if pruning is not None else start
                late.add(None, seq.positions(real_start, real_end), late_start, seq.regions[1], row.num_tokens)
            if end == seq.length:
                sampled.append(seq)
                sampled_at.append(late.tokens - 1)
        hidden = None
        if early.spans:
            attention = StepAttention(early_pool, early.spans, device, capture=(layer - 1, set(scored)))
            hidden = self.model.run_layers(torch.cat(early.embeds), early.position_ids(device), attention, 0, layer)
            for seq, offset, start, end in early_outputs:
                pruning = seq.pruning
                assert pruning is not None
                if pruning.layer_inputs is None:
                    pruning.layer_inputs = hidden.new_empty(seq.prompt.length, hidden.shape[1])
                pruning.layer_inputs[start:end] = hidden[offset:offset + end - start]
            for index, seq in scored.items():
                self._choose_survivors(seq, attention.captured[index], attention.scale)
        if not late.spans:   # only prompt chunks of pruned rows: nothing reaches the late layers or samples
            return [], torch.empty(0)
        inputs = [piece if isinstance(piece, torch.Tensor) else hidden[piece:piece + late.spans[span].num_tokens]
                  for span, piece in late_inputs]
        attention = StepAttention(late_pool, late.spans, device)
        out = self.model.run_layers(torch.cat(inputs), late.position_ids(device), attention, layer,
                                    late_pool.layers.stop)
        if not sampled:
            return [], out
        for seq in sampled:   # the prompt is done with: its layer-K inputs are no longer needed
            if seq.pruning is not None:
                seq.pruning.layer_inputs = None
        return sampled, self.model.final_norm(out[torch.tensor(sampled_at, device=device)])

    def _choose_survivors(self, seq: Sequence, query: torch.Tensor, scale: float) -> None:
        pruning = seq.pruning
        assert pruning is not None
        keys, _ = self.pools[0].read(seq.regions[0], pruning.layer - 1, seq.prompt.length)
        scores = attention_of_last_query(query, keys[0], scale)
        pruning.survivors = choose_survivors(scores, pruning.vision_mask, pruning.kept_vision)

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


class _Part:
    """The flattened tokens of the step that run through one range of layers."""

    def __init__(self) -> None:
        self.embeds: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.spans: list[RowSpan] = []
        self.tokens = 0

    def add(self, embeds: torch.Tensor | None, positions: torch.Tensor, start: int, region: Region,
            num_tokens: int | None = None) -> None:
        count = num_tokens if num_tokens is not None else positions.shape[1]
        if embeds is not None:
            self.embeds.append(embeds)
        self.positions.append(positions)
        self.spans.append(RowSpan(self.tokens, count, start, region, None))
        self.tokens += count

    def position_ids(self, device: torch.device) -> torch.Tensor:
        return torch.cat(self.positions, dim=1).to(device)
