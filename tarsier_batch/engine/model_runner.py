"""Turn a scheduled step into tensors, run the model once, and return the logits rows need.

Vision vectors are produced only when a chunk reaches them: the blocks a step touches are
encoded together (in micro-batches), kept for their row until a chunk has consumed their
last vector, then dropped. So a long video never holds all its vision vectors at once.

What the runner keeps of a row between steps (those vision vectors, a pruned row's layer-K
inputs) is its own, keyed by row id, and goes when the row lets go of its KV (`forget`); the
runner reads the rows and their KV (`ScheduledRow.kv`) and writes nothing into them: what a
step produces for a row (its logits, the survivors chosen for it) comes back in `StepOutput`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..families.base import CaptionModel, widened
from ..families.decoder import compile_for_any_sizes
from .attention import DecodeAttention, RowSpan, SplitDecodeAttention, StepAttention, paged_decode_attention, to_device
from .decode_step import DecodeStep
from .kv_cache import BlockTable, KVCache
from .kv_manager import RowKV
from .pruning import attention_of_last_query, choose_survivors
from .scheduler import ScheduledRow
from .sequence import Sequence

VISION_BLOCKS_PER_CALL = 16  # bounds the vision tower's activations in one call


class StepOutput(NamedTuple):
    sampled: list[Sequence]          # the rows that reached their last position, in the order of `logits`' rows
    logits: torch.Tensor | None      # their next-token logits (None when no row samples)
    survivors: list[tuple[Sequence, torch.Tensor]]   # pruned rows scored in the step, and the survivors chosen


@dataclass(eq=False)
class _RowState:
    """What the runner keeps of one row from step to step, until the row lets go of its KV."""

    kv: RowKV
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)   # vision block -> vectors, until consumed
    layer_inputs: torch.Tensor | None = None   # a pruned row's (P, hidden) layer-K inputs, during its stages
    survivors: torch.Tensor | None = None      # chosen in the step being run, until it returns them


class ModelRunner:
    def __init__(self, model: CaptionModel, pools: list[KVCache], compile_step: bool = False,
                 cuda_graphs: bool = False, fused_attention: bool = False):
        """`pools`: one cache of every layer, or (pruning) the layers before K's and the layers from K on's;
        `compile_step`: run the layers (and the split decode attention) through torch.compile; `cuda_graphs`:
        replay decode steps as CUDA graphs (on CUDA); `fused_attention`: decoding rows attend in the fused Triton
        kernel (on CUDA, where Triton is installed)."""
        self.model = model
        self.pools = pools
        if compile_step:
            model.compile()
        self.decode_attention = _decode_attention(model.device, compile_step, fused_attention)
        graphs = cuda_graphs and model.device.type == "cuda"
        self.decode_step = DecodeStep(model, pools, self.decode_attention, graphs, static_shapes=graphs or compile_step)
        self._rows: dict[int, _RowState] = {}

    def release_graphs(self) -> None:
        """Give back the CUDA graphs' memory (after running out of memory); they are recorded again as needed."""
        if self.decode_step.graphs is not None:
            self.decode_step.graphs.release()

    def forget(self, row_ids: list[int]) -> None:
        """Drop what is kept for rows that let go of their KV (finished, or preempted: recomputed from scratch)."""
        for row_id in row_ids:
            self._rows.pop(row_id, None)

    def layer_inputs(self, seq: Sequence) -> torch.Tensor | None:
        """A pruned row's layer-K inputs, while kept for its stages."""
        state = self._rows.get(seq.row_id)
        return state.layer_inputs if state is not None else None

    @torch.inference_mode()
    def run(self, step: list[ScheduledRow]) -> StepOutput:
        """Compute the step."""
        if DecodeStep.accepts(step):
            sampled, logits = self.decode_step.run(step)
            return self._output(sampled, logits, [])
        for row in step:
            self._rows.setdefault(row.seq.row_id, _RowState(row.kv)).kv = row.kv
        self._encode_vision(step)
        if len(self.pools) > 1:
            sampled, hidden = self._run_in_two_parts(step)
        else:
            sampled, hidden = self._run_whole(step)
        self._drop_consumed_vision(step)
        scored = [(row.seq, self._take_survivors(row.seq)) for row in step
                  if self._rows[row.seq.row_id].survivors is not None]
        return self._output(sampled, self.model.logits(hidden) if sampled else None, scored)

    def _output(self, sampled: list[Sequence], logits: torch.Tensor | None,
                survivors: list[tuple[Sequence, torch.Tensor]]) -> StepOutput:
        for seq in sampled:   # a pruned row's prompt is done with: its layer-K inputs are no longer needed
            state = self._rows.get(seq.row_id)
            if state is not None:
                state.layer_inputs = None
        return StepOutput(sampled, logits, survivors)

    def _take_survivors(self, seq: Sequence) -> torch.Tensor:
        state = self._rows[seq.row_id]
        survivors, state.survivors = state.survivors, None
        assert survivors is not None
        return survivors

    def _run_whole(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor]:
        """Every row's new positions through every layer; the final hidden states of the rows that sample."""
        inputs, spans, sampled_at, sampled = StepInputs(), [], [], []
        for row in step:
            seq, start = row.seq, row.seq.num_computed_tokens
            end = start + row.num_tokens
            spans.append(RowSpan(inputs.tokens, row.num_tokens, start, row.kv.tables[0] if row.kv.tables else None,
                                 row.kv.host))
            inputs.add(seq, start, end)
            if end == seq.length:
                sampled.append(seq)
                sampled_at.append(inputs.tokens - 1)
        device = self.model.device
        attention = StepAttention(self.pools[0], spans, device, decode_attention=self.decode_attention)
        hidden = self.model.forward(self._embed(inputs), inputs.position_ids(device), attention)
        return sampled, _rows_at(hidden, sampled_at) if sampled else hidden

    def _run_in_two_parts(self, step: list[ScheduledRow]) -> tuple[list[Sequence], torch.Tensor]:
        """Layers [0, K) then [K, end), each part with its own cache, when rows may be pruned (see
        `engine.pruning`).

        Rows not pruned and generated tokens go through both parts; a pruned row's prompt chunk
        only through the first (its layer-K inputs are kept), its survivors' chunk only through
        the second. Each part attends with its own slot offsets: in the late layers' cache a pruned
        row holds its survivors, then its generated tokens.
        """
        device = self.model.device
        parts = self._split(step)
        early, late = parts.early, parts.late
        hidden = None
        if early.spans:
            hidden = self._run_early(parts)
        if not late.spans:   # only prompt chunks of pruned rows: nothing reaches the late layers or samples
            return [], torch.empty(0)
        if hidden is not None and not parts.early_outputs and all(isinstance(piece, int)
                                                                  for _, piece in parts.late_inputs):
            late_hidden = hidden   # every early token goes on, in the same order
        else:
            late_hidden = torch.cat([piece if isinstance(piece, torch.Tensor)
                                     else hidden[piece:piece + late.spans[span].num_tokens]
                                     for span, piece in parts.late_inputs])
        late_pool = self.pools[1]
        attention = StepAttention(late_pool, late.spans, device, decode_attention=self.decode_attention)
        out = self.model.run_layers(late_hidden, late.inputs.position_ids(device), attention, late_pool.layers.start,
                                    late_pool.layers.stop)
        if not parts.sampled:
            return [], out
        return parts.sampled, self.model.final_norm(_rows_at(out, parts.sampled_at))

    def _split(self, step: list[ScheduledRow]) -> _TwoParts:
        """Which of the step's tokens go through which part of the layers, with which inputs."""
        parts = _TwoParts()
        early, late = parts.early, parts.late
        for row in step:
            seq, start = row.seq, row.seq.num_computed_tokens
            end = start + row.num_tokens
            pruning, prompt = seq.pruning, seq.prompt.length
            if pruning is not None and end <= prompt:              # the prompt through the early layers
                parts.early_outputs.append((seq, early.tokens, start, end))
                if end == prompt and pruning.survivors is None:
                    parts.scored[len(early.spans)] = seq
                early.add(seq, start, end, start, row.kv.tables[0])
                continue
            if pruning is not None and end <= prompt + pruning.num_survivors:   # survivors through the late layers
                layer_inputs = self._rows[seq.row_id].layer_inputs
                assert pruning.survivors is not None and layer_inputs is not None
                chosen = pruning.survivors[start - prompt:end - prompt]
                parts.late_inputs.append((len(late.spans), layer_inputs[chosen.to(self.model.device)]))
                late.add_survivors(seq.prompt.positions[:, chosen], start - prompt, row.kv.tables[1])
            else:   # a row not pruned, or generated tokens: both parts; late slots after the survivors
                survivors = pruning.num_survivors if pruning is not None else 0
                real_start, real_end = start - survivors, end - survivors
                parts.late_inputs.append((len(late.spans), early.tokens))
                early.add(seq, real_start, real_end, real_start, row.kv.tables[0])
                late_start = start - prompt if pruning is not None else start
                late.add(seq, real_start, real_end, late_start, row.kv.tables[1])
            if end == seq.length:
                parts.sampled.append(seq)
                parts.sampled_at.append(late.tokens - 1)
        return parts

    def _run_early(self, parts: _TwoParts) -> torch.Tensor:
        """The early part's tokens through layers [0, K): pruned rows' prompt chunks keep their layer-K inputs,
        and a row whose last prompt position is among them has its survivors chosen."""
        device, early, layer = self.model.device, parts.early, self.pools[1].layers.start
        attention = StepAttention(self.pools[0], early.spans, device, capture=(layer - 1, set(parts.scored)),
                                  decode_attention=self.decode_attention)
        hidden = self.model.run_layers(self._embed(early.inputs), early.inputs.position_ids(device), attention, 0,
                                       layer)
        for seq, offset, start, end in parts.early_outputs:
            state = self._rows[seq.row_id]
            if state.layer_inputs is None:
                state.layer_inputs = hidden.new_empty(seq.prompt.length, hidden.shape[1])
            state.layer_inputs[start:end] = hidden[offset:offset + end - start]
        for index, seq in parts.scored.items():
            self._choose_survivors(seq, attention.captured[index], attention.scale)
        return hidden

    def _choose_survivors(self, seq: Sequence, query: torch.Tensor, scale: float) -> None:
        state = self._rows[seq.row_id]
        pruning = seq.pruning
        assert pruning is not None
        keys, _ = self.pools[0].read(state.kv.tables[0], pruning.layer - 1, seq.prompt.length)
        scores = attention_of_last_query(query, keys[0], scale)
        state.survivors = choose_survivors(scores, pruning.vision_mask, pruning.kept_vision)

    def _embed(self, inputs: StepInputs) -> torch.Tensor:
        """Input vectors of the step's tokens: one embedding lookup, then the vision vectors of every block the
        step reaches put in place with one indexed copy."""
        embeds = self.model.embed_tokens(inputs.token_ids(self.model.device))
        targets: list[int] = []
        vectors: list[torch.Tensor] = []
        for offset, seq, start, end in inputs.vision_spans:
            encoded = self._rows[seq.row_id].encoded
            for index, block in enumerate(seq.prompt.vision_blocks):
                first, last = max(start, block.start), min(end, block.end)
                if first < last:
                    targets.extend(range(offset + first - start, offset + last - start))
                    vectors.append(encoded[index][first - block.start:last - block.start])
        if vectors:
            joined = _joined(vectors, dim=0)
            embeds = widened(embeds, joined.shape[1])
            embeds.index_copy_(0, to_device(targets, embeds.device), joined)
        return embeds

    def _drop_consumed_vision(self, step: list[ScheduledRow]) -> None:
        """Free the vectors of blocks whose last vector the step consumed (only once it succeeded)."""
        for row in step:
            end = row.seq.num_computed_tokens + row.num_tokens
            encoded = self._rows[row.seq.row_id].encoded
            for index, block in enumerate(row.seq.prompt.vision_blocks):
                if block.end <= end:
                    encoded.pop(index, None)

    def _encode_vision(self, step: list[ScheduledRow]) -> None:
        """Encode every vision block the step's chunks reach that is not encoded yet."""
        wanted: list[tuple[Sequence, int]] = []
        for row in step:
            seq, start = row.seq, row.seq.num_computed_tokens
            end = start + row.num_tokens
            encoded = self._rows[seq.row_id].encoded
            wanted += [(seq, index) for index, block in enumerate(seq.prompt.vision_blocks)
                       if block.start < end and block.end > start and index not in encoded]
        for first in range(0, len(wanted), VISION_BLOCKS_PER_CALL):
            batch = wanted[first:first + VISION_BLOCKS_PER_CALL]
            vectors = self.model.encode_vision([seq.prompt.pixel_values[index] for seq, index in batch],
                                               [seq.prompt.vision_blocks[index] for seq, index in batch])
            for (seq, index), block_vectors in zip(batch, vectors):
                self._rows[seq.row_id].encoded[index] = seq.prompt.vision_blocks[index].prompt_vectors(block_vectors)


class _TwoParts:
    """A step split at layer K: the tokens of each part, and what links them."""

    def __init__(self) -> None:
        self.early = _Part()
        self.late = _Part()
        self.early_outputs: list[tuple[Sequence, int, int, int]] = []   # (seq, offset in early part, start, end)
        self.scored: dict[int, Sequence] = {}                            # early span index -> row scored this step
        self.late_inputs: list[tuple[int, torch.Tensor | int]] = []      # per late span: its inputs, or early offset
        self.sampled: list[Sequence] = []
        self.sampled_at: list[int] = []


class _Part:
    """The flattened tokens of the step that run through one range of layers, and their spans."""

    def __init__(self) -> None:
        self.inputs = StepInputs()
        self.spans: list[RowSpan] = []

    @property
    def tokens(self) -> int:
        return self.inputs.tokens

    def add(self, seq: Sequence, start: int, end: int, kv_start: int, table: BlockTable) -> None:
        """Positions [start, end) of `seq`, cached from slot `kv_start` of `table` on."""
        self.spans.append(RowSpan(self.tokens, end - start, kv_start, table, None))
        self.inputs.add(seq, start, end)

    def add_survivors(self, positions: torch.Tensor, kv_start: int, table: BlockTable) -> None:
        self.spans.append(RowSpan(self.tokens, positions.shape[1], kv_start, table, None))
        self.inputs.add_positions(positions)


class StepInputs:
    """The token ids and positions of a step's flattened tokens, built on the host in as few tensors as
    the rows allow: the generated tokens of consecutive decoding rows become one tensor, not one each."""

    def __init__(self) -> None:
        self.tokens = 0
        self.vision_spans: list[tuple[int, Sequence, int, int]] = []   # (offset, seq, start, end) with vision
        self._ids: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._pending_ids: list[int] = []
        self._pending_positions: list[int] = []
        self._components = 1

    def add(self, seq: Sequence, start: int, end: int) -> None:
        """Positions [start, end) of `seq`, ids and positions both."""
        prompt = seq.prompt
        self._components = prompt.positions.shape[0]
        if end - start == 1 and start >= prompt.length:   # a generated token: plain ints
            self._pending_ids.append(seq.output_ids[start - prompt.length])
            self._pending_positions.append(prompt.next_position + start - prompt.length)
        else:
            self._flush()
            self._ids.append(seq.token_ids(start, end))
            self._positions.append(seq.positions(start, end))
            if any(block.start < end and block.end > start for block in prompt.vision_blocks):
                self.vision_spans.append((self.tokens, seq, start, end))
        self.tokens += end - start

    def add_positions(self, positions: torch.Tensor) -> None:
        """Tokens whose inputs come from elsewhere (a pruned row's survivors): positions only."""
        self._flush()
        self._positions.append(positions)
        self.tokens += positions.shape[1]

    def token_ids(self, device: torch.device) -> torch.Tensor:
        self._flush()
        return _joined(self._ids, dim=0).to(device, non_blocking=True)

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """(components, tokens) on `device`."""
        self._flush()
        return _joined(self._positions, dim=1).to(device, non_blocking=True)

    def _flush(self) -> None:
        if self._pending_ids:
            self._ids.append(torch.tensor(self._pending_ids))
            self._positions.append(torch.tensor(self._pending_positions).expand(self._components, -1))
            self._pending_ids, self._pending_positions = [], []


def _joined(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _rows_at(hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """The rows of `hidden` at `indices` (all of it, without a copy, when that is every row in order)."""
    if indices == list(range(hidden.shape[0])):
        return hidden
    return hidden[to_device(indices, hidden.device)]


def fused_attention_available(device: torch.device) -> bool:
    """Whether the fused decode attention can run here: a CUDA device, and Triton (which torch's CUDA builds bring)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _decode_attention(device: torch.device, compiled: bool, fused: bool) -> DecodeAttention:
    if fused and fused_attention_available(device):
        from .fused_decode import FusedDecodeAttention  # imports Triton
        return FusedDecodeAttention()
    return SplitDecodeAttention(compile_for_any_sizes(paged_decode_attention) if compiled else paged_decode_attention)
