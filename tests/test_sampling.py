"""Token choice: greedy argmax over the full vocabulary, top-p filtering, seeded streams."""

from __future__ import annotations

import pytest
import torch

from tarsier_batch.engine.sampling import (
    SamplingParams,
    _keep_top_p,
    _penalise_repeats,
    exponential_noise,
    seen_pairs,
    select_tokens,
)


def test_greedy_takes_the_argmax_of_each_row() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 6.0]])
    assert select_tokens(logits, SamplingParams(), [None, None], [0, 0]) == [1, 3]


def test_the_repetition_penalty_applies_to_each_row_s_own_ids_once() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.5], [2.0, -2.0, 1.5]])
    # Row 0 has seen ids 0 (twice) and 1; row 1 only id 2. Penalty 2: positive / 2, negative * 2.
    params = SamplingParams(repetition_penalty=2.0)
    assert select_tokens(logits, params, [None, None], [0, 0], ([0, 0, 0], [0, 1, 0])) == [2, 0]
    penalised = _penalise_repeats(logits, ([0, 0, 0, 1], [0, 1, 0, 2]), 2.0)
    torch.testing.assert_close(penalised, torch.tensor([[1.0, -4.0, 1.5], [2.0, -2.0, 0.75]]))


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    torch.testing.assert_close(_keep_top_p(probs.clone(), 0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(_keep_top_p(probs.clone(), 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(_keep_top_p(probs.clone(), 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_a_sampled_token_depends_on_its_row_s_seed_and_draw_alone() -> None:
    params = SamplingParams(temperature=1.0, seed=1)
    seeds = [params.row_seed("a"), params.row_seed("b")]
    logits = torch.zeros(2, 1000)
    first = select_tokens(logits, params, seeds, [0, 0])
    assert first == select_tokens(logits, params, seeds, [0, 0]) and first[0] != first[1]
    assert select_tokens(logits, params, seeds, [1, 1]) != first, "the next draw is another token"
    # Batch composition does not matter: row "b" alone, or after other rows, draws the same.
    assert select_tokens(logits[:1], params, seeds[1:], [0]) == first[1:]
    assert select_tokens(torch.zeros(3, 1000), params, [params.row_seed("c")] + seeds, [5, 0, 0])[1:] == first
    assert params.row_seed("a") != SamplingParams(temperature=1.0, seed=2).row_seed("a")
    assert SamplingParams().row_seed("a") is None


def test_the_counter_noise_draws_tokens_with_their_probabilities() -> None:
    """argmax(p / E) over Exp(1) noise is a draw from p: 20,000 draws of one row's stream land on each
    token about as often as p says (a chi-square test at a 1e-6 false-alarm rate)."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=torch.float64)
    draws = 20_000
    noise = exponential_noise(torch.full((draws,), 12345), torch.arange(draws), probs.shape[0])
    counts = torch.bincount((probs / noise).argmax(dim=-1), minlength=5).double()
    expected = probs * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 33.4, (counts, expected)   # chi-square(4 dof) quantile at 1 - 1e-6
    assert noise.min() > 0 and torch.isfinite(noise).all()


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_invalid_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_seen_pairs_hold_each_rows_prompt_vocabulary_and_generated_ids() -> None:
    # The engine's (row, id) pairs, built on the device from kept tensors, equal the pairs listed one by one,
    # rows of no generated ids and of an empty-looking vocabulary included; and penalise as those do.
    vocabularies = [torch.tensor([2, 5, 9]), torch.tensor([1]), torch.tensor([0, 3])]
    generated = [[5, 7], [], [8, 8, 3]]
    rows, ids = seen_pairs(vocabularies, generated, torch.device("cpu"))
    listed = [(row, int(token)) for row, (vocabulary, new) in enumerate(zip(vocabularies, generated))
              for token in [*vocabulary.tolist(), *new]]
    assert list(zip(rows.tolist(), ids.tolist())) == listed
    logits = torch.randn(3, 10)
    as_lists = ([row for row, _ in listed], [token for _, token in listed])
    assert torch.equal(_penalise_repeats(logits, (rows, ids), 1.3), _penalise_repeats(logits, as_lists, 1.3))
