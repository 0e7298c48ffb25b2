"""Token choice: greedy argmax over the full vocabulary, top-p filtering, seeded streams."""

from __future__ import annotations

import pytest
import torch

from tarsier_batch.engine.sampling import SamplingParams, _keep_top_p, select_tokens


def test_greedy_takes_the_argmax_of_each_row() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 6.0]])
    assert select_tokens(logits, SamplingParams(), [None, None]) == [1, 3]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    torch.testing.assert_close(_keep_top_p(probs.clone(), 0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(_keep_top_p(probs.clone(), 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(_keep_top_p(probs.clone(), 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_sampling_follows_the_item_generator() -> None:
    params = SamplingParams(temperature=1.0, seed=1)
    logits = torch.zeros(2, 1000)
    first = select_tokens(logits, params, [params.generator_for("a"), params.generator_for("b")])
    again = select_tokens(logits, params, [params.generator_for("a"), params.generator_for("b")])
    assert first == again and first[0] != first[1]
    assert params.generator_for("a").initial_seed() != SamplingParams(temperature=1.0, seed=2).generator_for("a").initial_seed()
    assert SamplingParams().generator_for("a") is None


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_invalid_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
