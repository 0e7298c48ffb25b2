"""Choosing the next token from logits: repetition penalty, then greedy or temperature and top-p sampling."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops. Temperature 0 means greedy."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float | None = None  # None: the checkpoint's generation_config.json value

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError("repetition penalty must be positive (1.0: none)")
        if self.temperature < 0:
            raise ValueError("temperature must be 0 (greedy) or positive")
        if not 0 < self.top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator_for(self, key: str) -> torch.Generator | None:
        """A generator seeded from the run seed and the item's key (its path).

        Each item draws from its own stream, so a sampled caption does not depend on which
        other items share its batch, or on the batch size.
        """
        if self.greedy:
            return None
        generator = torch.Generator()
        # The CPU generator keeps 32 bits of a seed, so mix seed and key into 32 bits.
        digest = hashlib.blake2b(f"{self.seed}\0{key}".encode(), digest_size=4).digest()
        generator.manual_seed(int.from_bytes(digest, "little"))
        return generator


def select_tokens(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None],
                  seen_ids: list[torch.Tensor] | None = None) -> list[int]:
    """One next token per row of `logits` (rows, vocab), chosen over the full vocabulary.

    With a repetition penalty other than 1, `seen_ids` holds each row's prompt and generated ids.
    """
    logits = logits.float()
    penalty = params.repetition_penalty
    if penalty is not None and penalty != 1:
        assert seen_ids is not None, "a repetition penalty needs each row's ids so far"
        logits = _penalise_repeats(logits, seen_ids, penalty)
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        probs = _keep_top_p(probs, params.top_p)
    probs = probs.cpu()
    return [int(torch.multinomial(row, 1, generator=generator)) for row, generator in zip(probs, generators)]


def _penalise_repeats(logits: torch.Tensor, seen_ids: list[torch.Tensor], penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: every id already in the row (prompt included) has its
    logit divided by `penalty` if positive, multiplied by it if negative."""
    logits = logits.clone()  # the model's logits may be an inference-mode tensor, not writable here
    for row, ids in zip(logits, seen_ids):
        ids = ids.to(row.device)
        scores = row[ids]
        row[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches `top_p`."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0  # the most likely token always has mass_before 0
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
