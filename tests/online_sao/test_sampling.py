"""The one definition of the sampling distribution that the engine and the learner share."""

from __future__ import annotations

import math

import torch

from online_sao.sampling import GREEDY_TEMPERATURE, nucleus_logprobs, nucleus_mask, sampled_logprobs
from tests.fixtures.engine_reference import reference_logprob


def test_ties_at_the_threshold_keep_the_lower_token_id():
    # four equally likely tokens: the nucleus of 0.5 is two of them, always the two lowest ids
    logp = torch.full((4,), math.log(0.25))
    assert nucleus_mask(logp, 0.5).tolist() == [True, True, False, False]
    assert nucleus_mask(logp.flip(0), torch.tensor(0.5)).tolist() == [True, True, False, False]


def test_batched_settings_match_one_distribution_at_a_time_and_a_float64_reference():
    torch.manual_seed(0)
    logits = 3.0 * torch.randn(6, 50)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.7, 1.0, 1.3])
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.5, 1.0, 0.9])
    batched = nucleus_logprobs(logits, temperature, top_p)
    for row in range(6):
        alone = nucleus_logprobs(logits[row], float(temperature[row]), float(top_p[row]))
        assert torch.equal(batched[row], alone)
        for token in range(50):
            expected = reference_logprob(logits[row], token, float(temperature[row]), float(top_p[row]))
            got = float(alone[token])
            assert (got == expected == -math.inf) or abs(got - expected) < 1e-5


def test_sampled_logprobs_gathers_the_nucleus_logprobs_and_their_gradient():
    torch.manual_seed(1)
    logits = (2.0 * torch.randn(2, 5, 40)).requires_grad_()
    tokens = torch.randint(0, 40, (2, 5))
    temperature = torch.tensor([[0.7, 1.0, 1.3, 1.0, 0.9]] * 2)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 1.0, 0.95], [0.5, 1.0, 1.0, 0.9, 1.0]])
    got = sampled_logprobs(logits, tokens, temperature, top_p)
    full = nucleus_logprobs(logits, temperature, top_p).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, full, atol=1e-6) and torch.equal(torch.isinf(got), torch.isinf(full))
    finite = torch.isfinite(full)
    (grad_got,) = torch.autograd.grad(got[finite].sum(), logits)
    (grad_full,) = torch.autograd.grad(full[finite].sum(), logits)
    assert torch.allclose(grad_got, grad_full, atol=1e-6)


def test_at_the_greedy_temperature_a_token_has_the_point_masss_log_probability():
    """The engines decode the arg-max there and log 0; the learner took the tempered distribution,
    which gives a tie's arg-max log(1/2), so the ratio was 1/2 with identical weights."""
    logits = torch.tensor([[[2.0, 2.0, -1.0], [0.5, 3.0, 3.0 - 1e-4]]], requires_grad=True)
    tokens = torch.tensor([[0, 2]])  # the first arg-max of a tie; the runner-up of a near tie
    temperature = torch.full((1, 2), GREEDY_TEMPERATURE)
    got = sampled_logprobs(logits, tokens, temperature, torch.ones(1, 2))
    assert got.tolist() == [[0.0, -math.inf]]
    assert sampled_logprobs(logits, torch.tensor([[1, 1]]), temperature, torch.tensor([[0.5, 1.0]])).tolist() \
        == [[-math.inf, 0.0]]  # token 1 is no arg-max of the first row (ties go to the lower id)
    (grad,) = torch.autograd.grad(got[0, 0], logits, allow_unused=True)
    assert grad is None or not grad.any()  # a point mass has no gradient
