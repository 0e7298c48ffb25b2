"""Choosing the next token from logits: repetition penalty, then greedy or temperature and top-p sampling."""

from __future__ import annotations

import torch

from ..settings import SamplingParams


def select_tokens(logits: torch.Tensor, params: SamplingParams, seeds: list[int | None], draws: list[int],
                  seen: tuple[torch.Tensor | list[int], torch.Tensor | list[int]] | None = None) -> list[int]:
    """One next token per row of `logits` (rows, vocab), chosen over the full vocabulary, for all rows at
    once; the list of tokens is the step's one copy from the device.

    `seeds` and `draws` name each row's sampling stream and which of its tokens this is (its count
    of generated tokens): a sampled token depends on them alone, not on the other rows. With a
    repetition penalty other than 1, `seen` holds (row, id) pairs of every id in each row's prompt
    and output (lists, or tensors from `seen_pairs`).
    """
    logits = logits.float()
    penalty = params.repetition_penalty
    if penalty is not None and penalty != 1:
        assert seen is not None, "a repetition penalty needs each row's ids so far"
        logits = _penalise_repeats(logits, seen, penalty)
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        probs = _keep_top_p(probs, params.top_p)
    assert all(seed is not None for seed in seeds), "sampling needs each row's seed"
    counters = torch.tensor([seeds, draws]).to(probs.device, non_blocking=True)
    noise = exponential_noise(counters[0], counters[1], probs.shape[1])
    # The exponential race: argmax(p / E) with E ~ Exp(1) independent per token is a draw from p.
    return (probs / noise).argmax(dim=-1).tolist()


def exponential_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float64 Exp(1) variables, a pure function of (seed, draw, token id) per element.

    Counter-based (a splitmix64-style hash of the three counters), so every row's noise comes from
    one computation for the whole batch and is the same on any device and in any batch.
    """
    ids = torch.arange(vocab, device=seeds.device)
    state = seeds.unsqueeze(1) * _GOLDEN + draws.unsqueeze(1) * _DRAW_STEP + ids.unsqueeze(0)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2)):
        state = (state ^ _shift_right(state, shift)) * multiplier
    state = state ^ _shift_right(state, 31)
    uniform = (_shift_right(state, 11).double() + 0.5) / 2.0**53      # 53 bits, in (0, 1)
    return -torch.log(uniform)


def _as_int64(value: int) -> int:
    """A 64-bit constant as the signed int64 torch multiplies with (wrapping modulo 2^64)."""
    return value - 2**64 if value >= 2**63 else value


def _shift_right(state: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (state >> shift) & ((1 << (64 - shift)) - 1)


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_DRAW_STEP = _as_int64(0xD1B54A32D192ED03)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def seen_pairs(prompt_vocabularies: list[torch.Tensor], generated: list[list[int]],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, ids) of every id a repetition penalty looks at, as `select_tokens`' `seen`: each row's distinct
    prompt ids (on `device` already, kept there across steps) and its generated ids.

    Built on the device from the rows' kept ids and one copy of the generated ones: a Python list of
    (row, id) pairs would cost the host a few ms per row and step at a 10k-position prompt of text.
    """
    new_ids = torch.tensor([token for ids in generated for token in ids], dtype=torch.long)
    new_ids = new_ids.to(device, non_blocking=True)
    parts, offset = [], 0
    for vocabulary, ids in zip(prompt_vocabularies, generated):
        parts += [vocabulary, new_ids[offset:offset + len(ids)]]
        offset += len(ids)
    counts = [len(vocabulary) + len(ids) for vocabulary, ids in zip(prompt_vocabularies, generated)]
    rows = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   torch.tensor(counts).to(device, non_blocking=True),
                                   output_size=sum(counts))   # given: no wait for the device to count them
    return rows, torch.cat(parts)


def _penalise_repeats(logits: torch.Tensor, seen: tuple[torch.Tensor | list[int], torch.Tensor | list[int]],
                      penalty: float) -> torch.Tensor:
    """transformers' repetition penalty, for every row at once: each id already in a row (prompt
    included) has its logit divided by `penalty` if positive, multiplied by it if negative."""
    logits = logits.clone()  # the model's logits may be an inference-mode tensor, not writable here
    rows, ids = (torch.as_tensor(part).to(logits.device, non_blocking=True) for part in seen)
    scores = logits[rows, ids]   # an id listed twice in a row gets the same value written twice
    logits[rows, ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches `top_p`."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs.masked_fill_(mass_before >= top_p, 0)  # the most likely token always has mass_before 0
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
